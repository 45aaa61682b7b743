"""The key layouts a measured job pushpulls, as lists of float32 sizes.

- ``keys``: ResNet-50's 161 parameters, one key each (as ``Trainer`` without
  flat buckets, or a loop over ``model.parameters()``);
- ``buckets``: the same values in the flat buckets of ``Trainer(flat_buckets=True)``
  at its default 4 MiB (kvstore/flat_buckets.py: parameters in backward's order, the
  reverse of the model's, a bucket closed once it reaches the size);
- ``flat``: one key of all the values (gloo's fastest layout in benchmarks.gpu_check).

``scale`` divides every size (at least 1 value each), so that on the CPU the bytes
cost little and the time per key shows.
"""

from __future__ import annotations

from math import prod

from benchmarks.harness.resnet50_shapes import resnet50_shapes

LAYOUTS = ("keys", "buckets", "flat")


def layout(name: str, scale: int = 1) -> list[int]:
    sizes = [prod(shape) for _, shape in resnet50_shapes()]
    if name == "buckets":
        from kvstore.torch import DEFAULT_BUCKET_BYTES     # (imports torch)
        sizes = buckets(sizes[::-1], DEFAULT_BUCKET_BYTES // 4)
    elif name == "flat":
        sizes = [sum(sizes)]
    elif name != "keys":
        raise ValueError(f"unknown layout {name!r} (one of {', '.join(LAYOUTS)})")
    return [max(1, n // scale) for n in sizes]


def buckets(sizes: list[int], cap: int) -> list[int]:
    """Sizes in order, summed into buckets closed once they reach ``cap`` values."""
    out, open_size = [], 0
    for n in sizes:
        open_size += n
        if open_size >= cap:
            out.append(open_size)
            open_size = 0
    return out + ([open_size] if open_size else [])
