"""A model of one synchronous step's time, calibrated on this machine's sweeps and checked
against the emulated-link runs.

    python -m benchmarks.model --help

- run.py: the command, the step-time model
- link.py: the link model against benchmarks.link's link.json files (``--link``)
"""
