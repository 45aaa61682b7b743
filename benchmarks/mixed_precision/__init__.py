"""What mixed precision on the wire (kv.set_multi_precision) costs and saves: the
ResNet-50 exchange of bfloat16 against float32 gradients.

    python -m benchmarks.mixed_precision --help

- run.py: the command
"""
