"""The ResNet-50 gradient exchange on one host: ours against gloo, MXNet, Ray and the machine's
ceilings, side by side; ``--before REF`` adds another commit's ours.

    python -m benchmarks.pushpull --help

- run.py: the command
- report.py: medians, ratios, the markdown report and chart
- the contenders: benchmarks.harness.contenders and benchmarks.harness.peers
"""
