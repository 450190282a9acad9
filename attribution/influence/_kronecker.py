"""A module's weight (and bias) as one Kronecker block: its inputs ``a`` and output gradients ``delta`` as rows.

For K-FAC/EK-FAC a module's trainable parameters form one ``(d_out, d_in)`` matrix: the weight's columns and, where
the bias is trainable, the bias as the last column (the input gets a column of ones; a frozen weight leaves only that
column): ``nn.Linear`` and HuggingFace's ``Conv1D`` as they are, a convolution with ``groups=1`` over
its unfolded patches (``d_in = in_channels * prod(kernel)``). Each position (a token, a patch) gives one row of
``a`` and one of ``delta``; an example's gradient is ``sum_t delta_t a_t^T``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._curvature import with_bias_column
from ._rules import _is_hf_conv1d as is_hf_conv1d


def has_block(module: nn.Module) -> bool:
    """Whether ``module``'s parameters form one Kronecker block (Linear, HF Conv1D, an ungrouped Conv1d/Conv2d)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return module.groups == 1
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def trainable(module: nn.Module) -> tuple[bool, bool]:
    """Whether the module's weight and its bias are trained (their gradients are in the block)."""
    bias = getattr(module, "bias", None)
    return bool(module.weight.requires_grad), bias is not None and bool(bias.requires_grad)


def input_rows(module: nn.Module, a: Tensor) -> Tensor:
    """``(batch, positions, d_in)``: the module's input per position (unfolded patches for a convolution)."""
    weight, bias = trainable(module)
    if not weight:
        return a.new_ones(a.shape[0], output_positions(module, a), 1)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        a, padding = padded(module, a)
        if isinstance(module, nn.Conv1d):
            a = a.unsqueeze(-2)
            kernel, stride, dilation, padding = (
                (1, *module.kernel_size),
                (1, *module.stride),
                (1, *module.dilation),
                (0, *padding),
            )
        else:
            kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
        rows = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)
    else:
        rows = a.reshape(a.shape[0], -1, a.shape[-1])
    return with_bias_column(rows) if bias else rows


def output_positions(module: nn.Module, a: Tensor) -> int:
    """How many positions the module's output has per example (its output is computed for that: cheap and exact)."""
    with torch.no_grad():
        return int(output_rows(module, module(a[:1])).shape[1])


def output_rows(module: nn.Module, delta: Tensor) -> Tensor:
    """``(batch, positions, d_out)``: the gradient at the module's output per position."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return delta.reshape(delta.shape[0], delta.shape[1], -1).transpose(1, 2)
    return delta.reshape(delta.shape[0], -1, delta.shape[-1])


def to_block(module: nn.Module, grads: dict[str, Tensor]) -> Tensor:
    """Per-example gradients ``{"weight", "bias"}`` (``(batch, *shape)``) as blocks ``(batch, d_out, d_in)``."""
    parts = []
    if "weight" in grads:
        weight = grads["weight"]
        parts.append(weight.transpose(1, 2) if is_hf_conv1d(module) else weight.reshape(*weight.shape[:2], -1))
    if "bias" in grads:
        parts.append(grads["bias"].unsqueeze(-1))
    return torch.cat(parts, dim=-1)


def from_block(module: nn.Module, block: Tensor) -> dict[str, Tensor]:
    """The inverse of :func:`to_block`: ``{"weight", "bias"}`` shaped like the module's parameters, batch first."""
    out: dict[str, Tensor] = {}
    weight, bias = trainable(module)
    if bias:
        block, out["bias"] = block[..., :-1], block[..., -1]
    if weight:
        shape = tuple(module.get_parameter("weight").shape)
        out["weight"] = block.transpose(1, 2) if is_hf_conv1d(module) else block.reshape(block.shape[0], *shape)
    return out


def padded(module: nn.Conv1d | nn.Conv2d, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input padded as the module's forward pads it where ``unfold`` cannot (``"same"``, non-zero modes)."""
    padding: Any = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return F.pad(a, module._reversed_padding_repeated_twice, mode=mode), (0,) * len(module.kernel_size)
    return a, tuple(padding)
