"""Gradient compression (2bit, 1bit, fp16) in one process: what compressing and decompressing
cost.

    python -m benchmarks.compress --help

- run.py: the command
"""
