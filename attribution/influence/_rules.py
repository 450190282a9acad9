"""Per-example gradient rules: each example's parameter gradient from a module's input ``a`` and output gradient.

Every rule takes the module's input ``a`` and the gradient ``delta`` of the loss sum with respect to the module's
output, both with the batch first (a sequence model's positions are summed), and returns, per parameter name
(``"weight"``, ``"bias"``), a ``(batch, *parameter.shape)`` tensor. The rules are pure tensor math;
:func:`rule_for` picks one by module type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import weight as weight_of
from ..models.norms import is_rms_norm, norm_eps, rms_norm_gain

Rule = Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]]


def linear(a: Tensor, delta: Tensor, *, bias: bool) -> dict[str, Tensor]:
    """``W (out, in)``: ``sum_t delta_t a_t^T`` per example, as one batched matmul; bias ``sum_t delta_t``."""
    batch = delta.shape[0]
    a3, d3 = a.reshape(batch, -1, a.shape[-1]), delta.reshape(batch, -1, delta.shape[-1])
    out = {"weight": torch.bmm(d3.transpose(1, 2), a3)}
    if bias:
        out["bias"] = d3.sum(1)
    return out


def outer_factors(module: nn.Module, a: Tensor, delta: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(left, right)`` with the weight gradient ``sum_t left_t right_t^T`` per example, ``(batch, positions, .)``.

    ``nn.Linear``'s ``(out, in)`` weight: ``(delta, a)``; HF ``Conv1D``'s ``(in, out)`` weight: ``(a, delta)``;
    ``nn.Embedding``'s ``(num_embeddings, dim)`` weight: ``(indices, delta)`` with ``left`` the ``(batch, positions)``
    token ids standing for one-hot rows (the ``padding_idx`` positions' ``delta`` zeroed, as autograd leaves that row).
    ``None`` for other modules.
    """
    batch = delta.shape[0]
    d3 = delta.reshape(batch, -1, delta.shape[-1])
    if isinstance(module, nn.Embedding) and not module.scale_grad_by_freq:
        ids = a.reshape(batch, -1)
        return ids, d3 if module.padding_idx is None else d3 * (ids != module.padding_idx).unsqueeze(-1).to(d3.dtype)
    if not (isinstance(module, nn.Linear) or _is_hf_conv1d(module)):
        return None
    a3 = a.reshape(batch, -1, a.shape[-1])
    return (d3, a3) if isinstance(module, nn.Linear) else (a3, d3)


def conv(
    a: Tensor,
    delta: Tensor,
    *,
    kernel_size: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
    bias: bool,
) -> dict[str, Tensor]:
    """Conv1d/Conv2d by unfolding: ``W[g] = delta[g] unfold(a)[g]^T`` per example and group; bias sums positions.

    ``a`` is ``(batch, in, *spatial)`` already padded beyond ``padding`` where the module pads otherwise (reflect,
    ``"same"``); a Conv1d is read as a Conv2d of height 1.
    """
    kernel, strides, pads, dils = kernel_size, stride, padding, dilation
    if len(kernel_size) == 1:  # Conv1d as a Conv2d of height 1
        a, delta = a.unsqueeze(-2), delta.unsqueeze(-2)
        kernel, strides, pads, dils = (1, *kernel_size), (1, *stride), (0, *padding), (1, *dilation)
    batch, channels, out_channels = a.shape[0], a.shape[1], delta.shape[1]
    columns = F.unfold(a, kernel, dilation=dils, padding=pads, stride=strides)  # (batch, in * k, positions)
    columns = columns.reshape(batch, groups, -1, columns.shape[-1])
    d = delta.reshape(batch, groups, out_channels // groups, -1)
    weight = torch.einsum("bgol,bgcl->bgoc", d, columns)
    out = {"weight": weight.reshape(batch, out_channels, channels // groups, *kernel_size)}
    if bias:
        out["bias"] = delta.reshape(batch, out_channels, -1).sum(-1)
    return out


def embedding(indices: Tensor, delta: Tensor, *, num_embeddings: int, padding_idx: int | None) -> dict[str, Tensor]:
    """Each example's rows of ``delta`` added at its indices; the ``padding_idx`` row gets none (as in autograd)."""
    batch, width = delta.shape[0], delta.shape[-1]
    idx = indices.reshape(batch, -1)
    offsets = torch.arange(batch, device=idx.device).unsqueeze(1) * num_embeddings
    rows = delta.new_zeros(batch * num_embeddings, width)
    rows.index_add_(0, (idx + offsets).reshape(-1), delta.reshape(-1, width))
    rows = rows.reshape(batch, num_embeddings, width)
    if padding_idx is not None:
        rows[:, padding_idx] = 0
    return {"weight": rows}


def gain(normalized: Tensor, delta: Tensor, *, shape: tuple[int, ...], bias: bool) -> dict[str, Tensor]:
    """A norm's gain ``sum_t delta_t * x_hat_t`` (the same for a ``1 + weight`` gain); bias ``sum_t delta_t``."""
    batch = delta.shape[0]
    d = delta.reshape(batch, -1, *shape)
    out = {"weight": (d * normalized.reshape(batch, -1, *shape)).sum(1)}
    if bias:
        out["bias"] = d.sum(1)
    return out


# -- the rules by module ---------------------------------------------------------------------------------------------
def _linear_rule(module: nn.Module, a: Tensor, delta: Tensor) -> dict[str, Tensor]:
    return linear(a, delta, bias=module.bias is not None)


def _hf_conv1d_rule(module: nn.Module, a: Tensor, delta: Tensor) -> dict[str, Tensor]:
    out = linear(a, delta, bias=module.bias is not None)
    out["weight"] = out["weight"].transpose(1, 2)  # HF Conv1D keeps its weight as (in, out)
    return out


def _conv_rule(module: nn.Module, a: Tensor, delta: Tensor) -> dict[str, Tensor]:
    assert isinstance(module, (nn.Conv1d, nn.Conv2d))
    padding: Any = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":  # pad as the module's forward does
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * len(module.kernel_size)
    return conv(
        a,
        delta,
        kernel_size=tuple(module.kernel_size),
        stride=tuple(module.stride),
        padding=tuple(padding),
        dilation=tuple(module.dilation),
        groups=module.groups,
        bias=module.bias is not None,
    )


def _embedding_rule(module: nn.Module, a: Tensor, delta: Tensor) -> dict[str, Tensor]:
    assert isinstance(module, nn.Embedding)
    return embedding(a, delta, num_embeddings=module.num_embeddings, padding_idx=module.padding_idx)


def _norm_rule(module: nn.Module, a: Tensor, delta: Tensor) -> dict[str, Tensor]:
    shape = tuple(_tensor(module, "weight").shape)
    return gain(normalized(module, a), delta, shape=shape, bias=getattr(module, "bias", None) is not None)


def _tensor(module: nn.Module, key: str) -> Tensor:
    """A parameter of ``module``, read through the one weight accessor (real values also when offloaded)."""
    value = weight_of(module, key)
    assert value is not None, key
    return value.detach()


def normalized(module: nn.Module, a: Tensor) -> Tensor:
    """The norm's own normalised input ``x_hat``: the module run with a neutral gain (and a zero bias).

    The neutral gain is ones, or zeros for a ``1 + weight`` gain (Gemma; :func:`attribution.models.rms_norm_gain`
    tells), so the result is the module's own arithmetic (HuggingFace's float32 upcast included), bitwise. Call it
    with no hooks on the module.
    """
    weight = _tensor(module, "weight")
    neutral = {"weight": torch.ones_like(weight)}
    if not isinstance(module, nn.LayerNorm) and rms_norm_gain(module, weight, norm_eps(module)) is not weight:
        neutral["weight"] = torch.zeros_like(weight)  # the module multiplies by 1 + weight
    if getattr(module, "bias", None) is not None:
        neutral["bias"] = torch.zeros_like(_tensor(module, "bias"))
    with torch.no_grad():
        return torch.func.functional_call(module, neutral, (a,), strict=False)


_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def rule_for(module: nn.Module) -> Rule | None:
    """The rule for ``module`` (it covers the module's ``weight`` and ``bias``), or ``None`` when there is none.

    An embedding with ``scale_grad_by_freq`` has none: its gradient depends on the whole batch's token counts.
    """
    if isinstance(module, nn.Linear):
        return _linear_rule
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return _conv_rule
    if isinstance(module, nn.Embedding):
        return None if module.scale_grad_by_freq else _embedding_rule
    if needs_plain_module(module):
        return _norm_rule
    if _is_hf_conv1d(module):
        return _hf_conv1d_rule
    return None


def needs_plain_module(module: nn.Module) -> bool:
    """Whether the rule runs the module itself (a norm's ``x_hat``), so it must run once the hooks are removed."""
    return isinstance(module, _NORM_TYPES) or is_rms_norm(module)


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2): a linear layer whose weight is ``(in, out)``."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return False
    return isinstance(module, Conv1D)
