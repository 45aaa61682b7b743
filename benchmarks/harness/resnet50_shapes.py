"""Parameter shapes of torchvision's ResNet-50, generated without torchvision.

The shapes follow ``torchvision.models.resnet50()`` exactly, in the order of
``model.named_parameters()``: ``conv1`` (7x7, 3 -> 64) and ``bn1``; four stages of
bottleneck blocks ([3, 4, 6, 3] blocks, widths 64/128/256/512, expansion 4), each
block ``conv1`` 1x1, ``bn1``, ``conv2`` 3x3, ``bn2``, ``conv3`` 1x1, ``bn3``, and in
the first block of every stage a ``downsample`` 1x1 convolution and its batch norm;
then ``fc`` (2048 -> 1000) and its bias. Batch-norm running statistics are
buffers, not parameters, and are not exchanged.

Example::

    >>> shapes = resnet50_shapes()
    >>> len(shapes), sum(size(s) for _, s in shapes)
    (161, 25557032)
"""

from __future__ import annotations

from math import prod

RESNET50_TENSORS = 161
RESNET50_VALUES = 25_557_032

BLOCKS = (3, 4, 6, 3)
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


def size(shape) -> int:
    return prod(shape)


def resnet50_shapes(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """[(parameter name, shape)] of ResNet-50 in ``named_parameters()`` order."""
    out: list[tuple[str, tuple[int, ...]]] = []

    def conv(name, cout, cin, k):
        out.append((f"{name}.weight", (cout, cin, k, k)))

    def bn(name, c):
        out.append((f"{name}.weight", (c,)))
        out.append((f"{name}.bias", (c,)))

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    inplanes = 64
    for stage, (blocks, width) in enumerate(zip(BLOCKS, WIDTHS), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            conv(f"{p}.conv1", width, inplanes, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)   # stride lives here (ResNet v1.5); shapes unchanged
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * EXPANSION, width, 1)
            bn(f"{p}.bn3", width * EXPANSION)
            if b == 0:  # stride or width changes: projection shortcut
                conv(f"{p}.downsample.0", width * EXPANSION, inplanes, 1)
                bn(f"{p}.downsample.1", width * EXPANSION)
            inplanes = width * EXPANSION
    out.append(("fc.weight", (num_classes, 512 * EXPANSION)))
    out.append(("fc.bias", (num_classes,)))
    return out


def tiny_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """A small parameter set with the same mix (a big tensor split into chunks,
    small ones fused): for tests and quick checks."""
    return [("conv.weight", (16, 3, 3, 3)), ("bn.weight", (16,)), ("bn.bias", (16,)),
            ("fc.weight", (10, 1000)), ("big.weight", (700_000,)), ("fc.bias", (10,))]


MODELS = {"resnet50": resnet50_shapes, "tiny": tiny_shapes}


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Shapes only, for a model name in :data:`MODELS`."""
    try:
        return [shape for _, shape in MODELS[name]()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None


def model_nbytes(name: str) -> int:
    """Bytes of one fp32 gradient of the model: what each worker pushes per exchange."""
    return 4 * sum(size(s) for s in model_shapes(name))


if __name__ == "__main__":
    shapes = resnet50_shapes()
    total = sum(size(s) for _, s in shapes)
    small = sum(1 for _, s in shapes if size(s) * 4 < 64 << 10)
    print(f"{len(shapes)} tensors, {total:,} values, {total * 4 / 1e6:.1f} MB fp32, "
          f"{small} under 64 KB")
