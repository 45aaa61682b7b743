"""The ResNet-50 gradient exchange over emulated machines: gloo's ring against ours co-located
and on dedicated server hosts, each against its wire bound.

    python -m benchmarks.link --help

- run.py: the command and one launch per layout (ours: benchmarks.harness.exchange)
- report.py: the bytes each link should carry, the summary, link.md
- timeline.py: every link's use every 20 ms (``--timeline``)
"""
