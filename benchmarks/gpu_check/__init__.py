"""The GPU path on a machine with an NVIDIA GPU: the GPU tests, then timed runs (aggregation,
the exchange against gloo, server rounds, phases, CUDA IPC).

    python -m benchmarks.gpu_check --help

- run.py: the command, its sections and report
- worker.py: one worker process of the timed runs
- phases.py: where an exchange with CUDA tensors spends its time
- ipc.py: CUDA IPC between two processes on one GPU
"""
