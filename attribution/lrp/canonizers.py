"""What LRP does to a model for one call, through hooks only: batch norms merged, residual sums split by share.

Nothing of the model is modified (no parameter, buffer, attribute or method is replaced); the hooks of
:class:`~attribution.LRP` read what these functions find:

* :func:`merged_batch_norms`: a batch norm that directly follows a convolution or linear layer (in
  ``named_modules()`` order, as zennit's ``SequentialMergeBatchNorm``) is merged into it: the rule sees one layer
  with weights ``W * g / sqrt(v + eps)`` and bias ``(b - m) * g / sqrt(v + eps) + beta`` (:func:`merge`).
* :func:`residual_blocks`: the blocks of torchvision ResNets and timm EfficientNet/MobileNet whose output is a sum
  ``act(branch + shortcut)`` get zennit's ``ResNetCanonizer`` treatment: the relevance of the output is split
  between the two summands in proportion to their values (the ``Norm`` rule), the activation after the sum passing
  it on unchanged.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    >>> merged_batch_norms(model)
    {'0': '1'}
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Residual", "merge", "merged_batch_norms", "residual_blocks"]

AFFINE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""The layers rules apply to (and subclasses, e.g. timm's ``Conv2dSame``)."""
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""Batch norms (and subclasses, e.g. timm's ``BatchNormAct2d``, whose activation then gets the ``Pass`` rule)."""


def units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules LRP treats as one layer, in ``named_modules()`` order: leaves, and batch norms with children."""
    skip: str | None = None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip):
            continue
        skip = None
        if isinstance(module, BATCH_NORMS):
            skip = name + "."
            yield name, module
        elif not any(True for _ in module.children()):
            yield name, module


def merged_batch_norms(model: nn.Module) -> dict[str, str]:
    """``{layer name: batch norm name}`` for every batch norm right after a conv/linear layer in module order."""
    pairs: dict[str, str] = {}
    previous: tuple[str, nn.Module] | None = None
    for name, module in units(model):
        if previous is not None and isinstance(previous[1], AFFINE) and isinstance(module, BATCH_NORMS):
            if module.running_mean is not None and module.running_var is not None:
                pairs[previous[0]] = name
        previous = (name, module)
    return pairs


def merge(layer: nn.Module, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of ``layer`` followed by the batch norm ``norm`` (eval mode), as one layer (zennit's merge).

    Example:
        >>> conv, bn = torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3).eval()
        >>> bn.running_mean.uniform_(); bn.running_var.uniform_(1, 2)  # doctest: +ELLIPSIS
        tensor(...)
        >>> w, b = merge(conv, bn)
        >>> x = torch.randn(1, 2, 4, 4)
        >>> torch.allclose(torch.nn.functional.conv2d(x, w, b), bn(conv(x)), atol=1e-6)
        True
    """
    mean, var = _buffer(norm, "running_mean"), _buffer(norm, "running_var")
    gamma, beta = getattr(norm, "weight", None), getattr(norm, "bias", None)
    weight, bias = _buffer(layer, "weight"), getattr(layer, "bias", None)
    eps = float(norm.eps)  # type: ignore[arg-type]
    scale = (gamma.detach() if gamma is not None else torch.ones_like(var)) / (var + eps) ** 0.5
    shift = beta.detach() if beta is not None else torch.zeros_like(scale)
    base = bias.detach() if bias is not None else torch.zeros_like(shift)
    index = (slice(None), *((None,) * (weight.dim() - 1)))
    return weight * scale[index], (base - mean) * scale + shift


def _buffer(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor)
    return value.detach()


@dataclass(frozen=True)
class Residual:
    """Where the summands of a residual block come from.

    Args:
        branch: the child whose output is the residual branch's last value (before the sum).
        shortcut: the child computing the shortcut, or ``None`` for the block's input; a child that is ``None``
            on the block (torchvision's ``downsample``) also means the input.
    """

    branch: str
    shortcut: str | None


def _torchvision_blocks() -> dict[type[nn.Module], Callable[[nn.Module], Residual | None]]:
    if "torchvision" not in sys.modules:  # a model of its blocks has imported it; do not pay for the import otherwise
        return {}
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return {
        BasicBlock: lambda m: Residual("bn2", "downsample" if m.downsample is not None else None),
        Bottleneck: lambda m: Residual("bn3", "downsample" if m.downsample is not None else None),
    }


def _timm_blocks() -> dict[type[nn.Module], Callable[[nn.Module], Residual | None]]:
    if "timm" not in sys.modules:
        return {}
    try:
        from timm.models._efficientnet_blocks import ConvBnAct, DepthwiseSeparableConv, InvertedResidual
    except ImportError:  # timm is optional
        return {}
    return {
        kind: lambda m: Residual("drop_path", None) if getattr(m, "has_skip", False) else None
        for kind in (ConvBnAct, DepthwiseSeparableConv, InvertedResidual)
    }


def residual_blocks(model: nn.Module) -> dict[str, Residual]:
    """``{block name: Residual}`` for every residual block of a known kind (torchvision ResNet, timm EfficientNet).

    Example:
        >>> import torchvision
        >>> blocks = residual_blocks(torchvision.models.resnet18())
        >>> blocks["layer1.0"], blocks["layer2.0"]
        (Residual(branch='bn2', shortcut=None), Residual(branch='bn2', shortcut='downsample'))
    """
    known = {**_torchvision_blocks(), **_timm_blocks()}
    found = {}
    for name, module in model.named_modules():
        describe = known.get(type(module))
        spec = describe(module) if describe is not None else None
        if spec is not None:
            found[name] = spec
    return found
