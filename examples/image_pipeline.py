"""The data and augmentation flags of MXNet's example/image-classification/common/data.py,
and the part of ImageRecordIter's default augmenter they drive, on uint8 images in memory.

    aug = ImageAug.from_args(args)          # --image-shape, --pad-size, --random-crop, ...
    x = aug.train(images[idx], rng)         # uint8 (N, 3, H, W) -> float32 (N, C, h, w)
    x = aug.val(images)                     # what MXNet's validation iterator does

What a training image goes through, in MXNet's order (src/io/image_aug_default.cc,
then the iterator's mirror and normalisation):

1. ``--pad-size P``: P pixels of ``--fill-value`` on each side;
2. a crop of ``--image-shape``'s height and width: at a random place with
   ``--random-crop 1``, else in the centre (rounding the offset down);
3. ``--random-mirror 1``: a horizontal flip with probability 1/2;
4. ``(pixel - mean) / std`` per channel, with ``--rgb-mean`` and ``--rgb-std``
   (red, green, blue).

A validation image is not padded, cropped in the centre, never flipped, and
normalised the same way (MXNet's validation iterator gets neither the pad nor the
random flags). The other augmentations of data.py (rotation, shear, scale, aspect
ratio, random-resized crops, crop sizes, HSL, brightness, contrast, saturation and
PCA noise) are not in this pipeline: their flags are accepted at MXNet's defaults,
and any other value raises ValueError naming the flag, never a silent no-op. A crop
larger than the (padded) image, which MXNet fills by resizing, is refused too.

Random draws, in this order: ``rng.integers(0, R + 1, size=(N, 2))`` (row and column
offsets; ``R`` an array of the two ranges when they differ) with --random-crop, then
``rng.random((N,))`` (which images to flip) with --random-mirror.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

IMAGENET_MEAN = "123.68,116.779,103.939"   # data.py's default --rgb-mean

# flag -> (MXNet's default, what it would do): augmentations this pipeline does not have
NOT_HERE = {
    "max_random_h": (0, "hue jitter"),
    "max_random_s": (0, "saturation jitter in HSL"),
    "max_random_l": (0, "lightness jitter"),
    "min_random_aspect_ratio": (None, "random aspect ratio"),
    "max_random_aspect_ratio": (0, "random aspect ratio"),
    "max_random_rotate_angle": (0, "random rotation"),
    "max_random_shear_ratio": (0, "random shear"),
    "max_random_scale": (1, "random scaling"),
    "min_random_scale": (1, "random scaling"),
    "max_random_area": (1, "random-resized crops"),
    "min_random_area": (1, "random-resized crops"),
    "min_crop_size": (-1, "random crop sizes"),
    "max_crop_size": (-1, "random crop sizes"),
    "brightness": (0, "brightness jitter"),
    "contrast": (0, "contrast jitter"),
    "saturation": (0, "saturation jitter"),
    "pca_noise": (0, "PCA lighting noise"),
    "random_resized_crop": (0, "random-resized crops"),
}


def add_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """MXNet's ``add_data_args`` (data.py), with its defaults."""
    data = parser.add_argument_group("Data", "the input images")
    add = data.add_argument
    add("--data-train", type=str, help="the training data: a directory of CIFAR-10 python batches "
        "(data_batch_1, ...) or one batch file (default: --data-dir)")
    add("--data-train-idx", type=str, default="", help="MXNet: the index of a RecordIO file (not read here; "
        "only the default '' is accepted)")
    add("--data-val", type=str, help="the validation data: a directory holding test_batch or one batch file "
        "(default: the test_batch beside the training data; '' for none)")
    add("--data-val-idx", type=str, default="", help="MXNet: the index of a RecordIO file (only '' here)")
    add("--rgb-mean", type=str, default=IMAGENET_MEAN, help="a tuple of size 3 for the mean rgb")
    add("--rgb-std", type=str, default="1,1,1", help="a tuple of size 3 for the std rgb")
    add("--pad-size", type=int, default=0, help="padding the input image")
    add("--fill-value", type=int, default=127, help="set the padding pixels value to fill_value")
    add("--image-shape", type=str, help="the image shape feed into the network, e.g. 3,28,28")
    add("--num-classes", type=int, help="the number of classes")
    add("--num-examples", type=int, help="the number of training examples (an epoch is this many images "
        "over all workers)")
    add("--data-nthreads", type=int, default=4, help="MXNet: threads for data decoding (accepted; the "
        "images here are decoded once, in memory)")
    add("--benchmark", type=int, default=0, help="if 1, then feed the network with synthetic data")
    return data


def add_data_aug_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """MXNet's ``add_data_aug_args`` (data.py), with its defaults. Only --random-crop and
    --random-mirror act here; the others must keep their defaults (see NOT_HERE)."""
    aug = parser.add_argument_group("Image augmentations", "as src/io/image_aug_default.cc")
    add = aug.add_argument
    add("--random-crop", type=int, default=0, help="if or not randomly crop the image")
    add("--random-mirror", type=int, default=0, help="if or not randomly flip horizontally")
    not_here = " (not in this pipeline: only the default)"
    add("--max-random-h", type=int, default=0, help="max change of hue" + not_here)
    add("--max-random-s", type=int, default=0, help="max change of saturation" + not_here)
    add("--max-random-l", type=int, default=0, help="max change of intensity" + not_here)
    add("--min-random-aspect-ratio", type=float, default=None, help="min value of aspect ratio" + not_here)
    add("--max-random-aspect-ratio", type=float, default=0, help="max value of aspect ratio" + not_here)
    add("--max-random-rotate-angle", type=int, default=0, help="max angle to rotate" + not_here)
    add("--max-random-shear-ratio", type=float, default=0, help="max ratio to shear" + not_here)
    add("--max-random-scale", type=float, default=1, help="max ratio to scale" + not_here)
    add("--min-random-scale", type=float, default=1, help="min ratio to scale" + not_here)
    add("--max-random-area", type=float, default=1, help="max area to crop in random resized crop" + not_here)
    add("--min-random-area", type=float, default=1, help="min area to crop in random resized crop" + not_here)
    add("--min-crop-size", type=int, default=-1, help="min random crop size" + not_here)
    add("--max-crop-size", type=int, default=-1, help="max random crop size" + not_here)
    add("--brightness", type=float, default=0, help="brightness jittering" + not_here)
    add("--contrast", type=float, default=0, help="contrast jittering" + not_here)
    add("--saturation", type=float, default=0, help="saturation jittering" + not_here)
    add("--pca-noise", type=float, default=0, help="pca noise" + not_here)
    add("--random-resized-crop", type=int, default=0, help="whether to use random resized crop" + not_here)
    return aug


def parse_floats(flag: str, text: str, count: int) -> tuple[float, ...]:
    """``"1,2,3"`` -> (1.0, 2.0, 3.0); ValueError naming ``flag`` unless exactly ``count`` numbers."""
    try:
        values = tuple(float(v) for v in text.strip().strip("()").split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        raise ValueError(f"{flag} {text!r}: expected {count} comma-separated numbers")
    return values


def parse_shape(text: str | None) -> tuple[int, int, int]:
    """``--image-shape``: ``"3,28,28"`` (or ``"(3,28,28)"``) -> (3, 28, 28)."""
    if not text:
        raise ValueError("--image-shape is required, e.g. --image-shape 3,28,28")
    try:
        shape = tuple(int(v) for v in text.strip().strip("()").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--image-shape {text!r}: expected channels,height,width, e.g. 3,28,28")
    if shape[0] != 3:
        raise ValueError(f"--image-shape {text!r}: the images here are RGB, so 3 channels "
                         f"(MXNet's gray conversion for 1 is not in this pipeline)")
    return shape[0], shape[1], shape[2]


@dataclass(frozen=True)
class ImageAug:
    """The pipeline of the module docstring for images cropped to ``shape`` (C, H, W)."""

    shape: tuple[int, int, int]
    pad: int = 0
    fill_value: int = 127
    random_crop: bool = False
    random_mirror: bool = False
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def __post_init__(self):
        if self.pad < 0:
            raise ValueError(f"--pad-size must be >= 0, got {self.pad}")
        if not 0 <= self.fill_value <= 255:
            raise ValueError(f"--fill-value must be a pixel value in 0..255, got {self.fill_value}")
        if any(s == 0 or not np.isfinite(s) for s in self.std) or not all(np.isfinite(self.mean)):
            raise ValueError(f"--rgb-std must be finite and nonzero and --rgb-mean finite, got "
                             f"{self.std} and {self.mean}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ImageAug:
        """The pipeline of the parsed data and augmentation flags. Raises ValueError naming
        the flag for a value this pipeline cannot honour."""
        for flag, (default, what) in NOT_HERE.items():
            value = getattr(args, flag)
            if value != default:
                raise ValueError(f"--{flag.replace('_', '-')} {value}: {what} is not in this script's image "
                                 f"pipeline (pad, crop, mirror, mean/std); leave it at MXNet's default "
                                 f"{default}")
        for flag in ("data_train_idx", "data_val_idx"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: a RecordIO index; "
                                 f"this script reads the CIFAR-10 python batches, which need none")
        return cls(shape=parse_shape(args.image_shape), pad=args.pad_size, fill_value=args.fill_value,
                   random_crop=bool(args.random_crop), random_mirror=bool(args.random_mirror),
                   mean=parse_floats("--rgb-mean", args.rgb_mean, 3),  # type: ignore[arg-type]
                   std=parse_floats("--rgb-std", args.rgb_std, 3))     # type: ignore[arg-type]

    def check_fits(self, height: int, width: int) -> None:
        """ValueError unless a crop of ``shape`` fits images of ``height`` x ``width`` as they
        are (the validation crop; the training crop, of the padded image, then fits too)."""
        _, h, w = self.shape
        if h > height or w > width:
            raise ValueError(f"--image-shape {','.join(map(str, self.shape))}: the crop is larger than the "
                             f"{height}x{width} images (MXNet would resize them up; this pipeline does not)")

    def train(self, images: np.ndarray, rng) -> np.ndarray:
        """Pad, crop, mirror and normalise uint8 images (N, 3, H, W) -> float32 (N, 3, h, w)."""
        images = self._checked(images)
        n, _, height, width = images.shape
        _, h, w = self.shape
        self.check_fits(height, width)
        if self.pad:
            images = np.pad(images, ((0, 0), (0, 0), (self.pad, self.pad), (self.pad, self.pad)),
                            constant_values=self.fill_value)
        ranges = (images.shape[2] - h, images.shape[3] - w)
        if self.random_crop:
            high = ranges[0] + 1 if ranges[0] == ranges[1] else np.array([ranges[0] + 1, ranges[1] + 1])
            offsets = np.asarray(rng.integers(0, high, size=(n, 2)))
        else:
            offsets = np.tile([ranges[0] // 2, ranges[1] // 2], (n, 1))
        flips = rng.random((n,)) < 0.5 if self.random_mirror else np.zeros(n, bool)
        return self.normalise(_crop(images, offsets, h, w, flips))

    def val(self, images: np.ndarray) -> np.ndarray:
        """Centre-crop and normalise (no pad, no flip), as MXNet's validation iterator."""
        images = self._checked(images)
        n, _, height, width = images.shape
        _, h, w = self.shape
        self.check_fits(height, width)
        offsets = np.tile([(height - h) // 2, (width - w) // 2], (n, 1))
        return self.normalise(_crop(images, offsets, h, w, np.zeros(n, bool)))

    def _checked(self, images) -> np.ndarray:
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images of shape (N, 3, H, W), got {images.shape}")
        if images.dtype != np.uint8:
            raise ValueError(f"expected uint8 images, got {images.dtype}")
        return images

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (N, 3, H, W) -> float32 ``(pixel - mean) / std`` per channel."""
        # a lookup (channel, value) -> (value - mean) / std, computed in float64 once
        values = np.arange(256, dtype=np.float64)[None, :]
        table = ((values - np.array(self.mean)[:, None]) / np.array(self.std)[:, None]).astype(np.float32)
        return table[np.arange(3)[None, :, None, None], pixels]


def _crop(images: np.ndarray, offsets: np.ndarray, h: int, w: int, flips: np.ndarray) -> np.ndarray:
    """For each image i, rows offsets[i, 0] + 0..h-1 and columns offsets[i, 1] + 0..w-1,
    the columns read backwards where flips[i]."""
    n = len(images)
    rows = offsets[:, :1] + np.arange(h)                          # (N, h)
    cols = offsets[:, 1:] + np.arange(w)                          # (N, w)
    cols = np.where(flips[:, None], cols[:, ::-1], cols)
    return images[np.arange(n)[:, None, None, None], np.arange(3)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
