"""One training step end to end: kvstore.torch.Trainer against torch DDP, on one host or over
emulated links.

    python -m benchmarks.trainer --help

- run.py: the command
- contenders.py: the contenders and how one launch of each is started
- worker.py: every process of a launch
- check.py: every worker's parameters against the reference
- report.py: the summary, the prediction, the markdown report
"""
