"""The cuda_ipc data plane's cost per key, measured on the CPU: ``dist_device_sync``
jobs whose GPUs are emulated with exportable host memory (kvstore.devices.host_sharing),
so every byte moves as on a GPU (no host copy) and what is left is Python per key.

    python -m benchmarks.emulated_ipc --help

- run.py: the command and its report
- job.py: one worker or server process of a measured job
"""
