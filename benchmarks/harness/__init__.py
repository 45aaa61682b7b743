"""What the experiments share (docs/architecture.md, "Benchmarks"). Imports nothing itself:
the peers' virtual environments (MXNet, Ray, TorchRec) import ``common`` and ``zipf`` alone.

- common: the values pushed and their exact sums, statistics, result files, REPO, RESULTS
- output: where an experiment writes its results (--out-dir; a new scratch directory
  by default; --record: its directory under benchmarks/results)
- procs: a group of processes, stopped together when one fails or the deadline passes
- netns: emulated hosts (network namespaces, rate-limited links); placement: which
  process runs on which; layouts: the layouts of W workers and S servers, their wire model
- exchange: one job of ours over emulated hosts (run_ours), its settings and versions
- throttle: a straggler made from outside (SIGSTOP/SIGCONT)
- resnet50_shapes: the parameter sets (ResNet-50, tiny); zipf: the sparse benchmarks' ids
- contenders: ours, gloo and the machine's ceilings (their workers, our server wrapper)
- peers: MXNet and Ray in benchmarks/.venv-*, and the MXNet optimizer fixture
"""
