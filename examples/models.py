"""Image-classification networks of MXNet's example/image-classification/symbols, in PyTorch.

    get_network("resnet", num_classes=10, num_layers=20)       # CIFAR-sized by default

- ``mlp``: flatten, fc 128 relu, fc 64 relu, fc classes (MXNet's mlp.py).
- ``lenet``: conv5x5 20 tanh maxpool, conv5x5 50 tanh maxpool, fc 500 tanh, fc classes
  (lenet.py); any image_shape, e.g. (1, 28, 28) or (3, 32, 32).
- ``resnet`` (num_layers 20, 56, 110): CIFAR ResNet (He et al. 2016), 3 stages of
  (num_layers - 2) / 6 basic blocks with 16/32/64 channels. Pre-activation units
  (BN-ReLU-conv, "Identity Mappings in Deep Residual Networks") as MXNet's resnet.py
  builds for CIFAR, including its 1x1-conv shortcut on the first unit of every stage.
  MXNet's BatchNorm on the raw input (``bn_data``: fix_gamma, so a learned shift
  only) is there with ``data_bn=True`` (train_cifar10.py: MXNet's default --rgb-std
  is 1, so the inputs come unscaled); without it the inputs should come normalised
  (cifar10.preprocess / cifar10.augment).
- ``inception-bn``: MXNet's inception-bn-28-small (conv factory, simple inception
  units, downsample factories), with a global average pool so 32x32 inputs work.
- ``vgg`` (num_layers 11, 13, 16, 19): VGG with BatchNorm (vgg.py, batch_norm=True);
  for CIFAR an adaptive average pool and a 512-512-classes classifier replace the
  4096-wide ImageNet head.

Convolutions followed by BatchNorm have no bias (BatchNorm's shift makes it redundant);
BatchNorm uses MXNet's eps of 2e-5. Weights use PyTorch's default initialisation, so
construction is deterministic for a given ``torch.manual_seed``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BN_EPS = 2e-5  # MXNet's BatchNorm default

DEPTHS = {"mlp": None, "lenet": None, "resnet": (20, 56, 110), "inception-bn": None,
          "vgg": (11, 13, 16, 19)}

# VGG: convolutions per stage (each stage ends with a 2x2 max pool), as MXNet's vgg.py
VGG_STAGES = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}
VGG_CHANNELS = (64, 128, 256, 512, 512)


def valid_networks() -> str:
    """'mlp, lenet, resnet (num_layers 20, 56, 110), ...' for error messages and --help."""
    return ", ".join(name if depths is None else f"{name} (num_layers {', '.join(map(str, depths))})"
                     for name, depths in DEPTHS.items())


def get_network(name: str, num_classes: int = 10, num_layers: int | None = None,
                image_shape=(3, 32, 32), data_bn: bool = False) -> nn.Module:
    """Build network ``name`` for images of ``image_shape`` (C, H, W) and ``num_classes``
    classes. The model returns logits (no softmax). ``data_bn`` (resnet only): MXNet's
    BatchNorm of the input. Raises ValueError, listing the valid names and depths, for an
    unknown name or a depth the network does not have."""
    if name not in DEPTHS:
        raise ValueError(f"unknown network {name!r}; valid networks: {valid_networks()}")
    depths = DEPTHS[name]
    if depths is None and num_layers is not None:
        raise ValueError(f"network {name!r} has a fixed depth: leave num_layers unset "
                         f"(valid networks: {valid_networks()})")
    if depths is not None and num_layers not in depths:
        raise ValueError(f"network {name!r} needs num_layers in {', '.join(map(str, depths))}, "
                         f"got {num_layers!r} (valid networks: {valid_networks()})")
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (channels, height, width), got {image_shape!r}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if data_bn and name != "resnet":
        raise ValueError(f"data_bn is MXNet's resnet's, not {name!r}'s")
    channels = image_shape[0]
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(image_shape), 128), nn.ReLU(),
                             nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, num_classes))
    if name == "lenet":
        return lenet(image_shape, num_classes)
    if name == "resnet":
        assert num_layers is not None   # one of DEPTHS["resnet"] (checked above)
        return ResNet(num_layers, num_classes, channels, data_bn=data_bn)
    if name == "inception-bn":
        return inception_bn_small(num_classes, channels)
    assert num_layers is not None   # one of DEPTHS["vgg"] (checked above)
    return vgg(num_layers, num_classes, channels)


def lenet(image_shape, num_classes: int) -> nn.Sequential:
    channels, height, width = image_shape
    h, w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2   # two (conv5x5, pool2)
    if h < 1 or w < 1:
        raise ValueError(f"lenet needs images of at least 12x12, got {height}x{width}")
    return nn.Sequential(
        nn.Conv2d(channels, 20, 5), nn.Tanh(), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 50, 5), nn.Tanh(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(50 * h * w, 500), nn.Tanh(), nn.Linear(500, num_classes))


# ---------------------------------------------------------------- ResNet (pre-activation)

class ResidualUnit(nn.Module):
    """BN-ReLU-conv3x3(stride)-BN-ReLU-conv3x3, plus the input; when ``dim_match`` is
    false, the shortcut is a 1x1 conv (with the stride) of the first activation."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, dim_match: bool):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=BN_EPS)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=BN_EPS)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.relu = nn.ReLU()
        self.shortcut = None if dim_match else nn.Conv2d(in_channels, out_channels, 1, stride,
                                                         bias=False)

    def forward(self, x):
        act1 = self.relu(self.bn1(x))
        out = self.conv2(self.relu(self.bn2(self.conv1(act1))))
        return out + (x if self.shortcut is None else self.shortcut(act1))


class DataBatchNorm(nn.Module):
    """MXNet's ``BatchNorm(fix_gamma=True)`` of the input: normalised by the batch's
    statistics (running ones in eval), then a learned shift; the scale stays 1."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels, eps=BN_EPS, affine=False)
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        return self.norm(x) + self.bias[None, :, None, None]


class ResNet(nn.Module):
    """CIFAR ResNet-``num_layers``: [``data_bn``: BatchNorm of the input,] conv3x3 16, then
    3 stages of (num_layers - 2) / 6 units with 16, 32, 64 channels (stride 2 at the
    start of stages 2 and 3), then BN-ReLU, global average pool and fc."""

    def __init__(self, num_layers: int, num_classes: int = 10, in_channels: int = 3, data_bn: bool = False):
        super().__init__()
        units = (num_layers - 2) // 6
        widths = (16, 32, 64)
        layers: list[nn.Module] = [DataBatchNorm(in_channels)] if data_bn else []
        layers.append(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False))
        previous = 16
        for stage, width in enumerate(widths):
            layers.append(ResidualUnit(previous, width, 1 if stage == 0 else 2, dim_match=False))
            layers += [ResidualUnit(width, width, 1, dim_match=True) for _ in range(units - 1)]
            previous = width
        layers += [nn.BatchNorm2d(previous, eps=BN_EPS), nn.ReLU(),
                   nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(previous, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


# ---------------------------------------------------------------- Inception-BN (28-small)

def conv_factory(in_channels: int, out_channels: int, kernel: int, stride: int = 1,
                 pad: int = 0) -> nn.Sequential:
    """MXNet's ConvFactory: conv, BatchNorm, ReLU."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel, stride, pad, bias=False),
                         nn.BatchNorm2d(out_channels, eps=BN_EPS), nn.ReLU())


class SimpleFactory(nn.Module):
    """Concat of a 1x1 conv factory (ch_1x1) and a 3x3 conv factory (ch_3x3)."""

    def __init__(self, in_channels: int, ch_1x1: int, ch_3x3: int):
        super().__init__()
        self.conv1x1 = conv_factory(in_channels, ch_1x1, 1)
        self.conv3x3 = conv_factory(in_channels, ch_3x3, 3, pad=1)
        self.out_channels = ch_1x1 + ch_3x3

    def forward(self, x):
        return torch.cat([self.conv1x1(x), self.conv3x3(x)], dim=1)


class DownsampleFactory(nn.Module):
    """Concat of a stride-2 3x3 conv factory (ch_3x3) and a stride-2 3x3 max pool."""

    def __init__(self, in_channels: int, ch_3x3: int):
        super().__init__()
        self.conv = conv_factory(in_channels, ch_3x3, 3, stride=2, pad=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.out_channels = ch_3x3 + in_channels

    def forward(self, x):
        return torch.cat([self.conv(x), self.pool(x)], dim=1)


def inception_bn_small(num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """inception-bn-28-small: conv 96, in3a-c, in4a-e, in5a-b, global avg pool, fc."""
    layers: list[nn.Module] = [conv_factory(in_channels, 96, 3, pad=1)]
    channels = 96
    # (kind, ch_1x1, ch_3x3) or ("down", ch_3x3): in3a, in3b, in3c, in4a..in4e, in5a, in5b
    plan: list[tuple[str, int, int] | tuple[str, int]] = [("simple", 32, 32), ("simple", 32, 48), ("down", 80),
            ("simple", 112, 48), ("simple", 96, 64), ("simple", 80, 80), ("simple", 48, 96),
            ("down", 96), ("simple", 176, 160), ("simple", 176, 160)]
    for kind, *widths in plan:
        unit = SimpleFactory(channels, *widths) if kind == "simple" else DownsampleFactory(channels, *widths)
        layers.append(unit)
        channels = unit.out_channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- VGG with BatchNorm

def vgg(num_layers: int, num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    layers, channels = [], in_channels
    for convs, width in zip(VGG_STAGES[num_layers], VGG_CHANNELS):
        for _ in range(convs):
            layers += [nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                       nn.BatchNorm2d(width, eps=BN_EPS), nn.ReLU()]
            channels = width
        layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))   # ceil: small images keep >= 1 pixel
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(channels, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)
