"""What the timeline (KVSTORE_TIMELINE) costs: off, on, and another commit without its hooks.

    python -m benchmarks.timeline_overhead --help

- run.py: the command
"""
