"""Frozen attention whose backward is one batched product for all rows of a batch.

With the query and key projections detached (``_frozen._freeze_attention``) a head's output is ``P @ V`` with the
probabilities ``P`` constant. Left to autograd, the gradient ``P^T @ dout`` under ``torch.func.vmap`` (the rows of a
batch) goes through ``bmm``'s batching rule, which expands ``P`` to every row and copies it: ``rows x heads x T x T``
per layer, most of a long prompt's time and memory. Here the attention's output is written again as the output
projection of :class:`_HeldMix`, whose value is the model's own mixed values and whose backward hands the rows to
:class:`_ValueGradients`; that one's ``vmap`` rule folds the rows into the columns of one product
(:func:`~attribution.graphs._math.value_gradients`).

Where the layer is found and split (the value projection or the value block of a fused one, the output
projection, the head counts) comes from the model reader's :class:`~attribution.models.LMLayout`. A layer is
rewritten only when, at the clean point, ``P @ V`` gives the output projection's input and the output projection
gives the attention's output (to float tolerance); else it keeps the model's own backward (correct, slower).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hooks import HookGroup

from .._run import hook_site
from ..models import LMLayout, linear
from ._math import value_gradients


class _ValueGradients(torch.autograd.Function):
    """``(probs, grads) -> dV``; under ``vmap`` the rows are folded into one product, ``probs`` never copied."""

    generate_vmap_rule = False

    @staticmethod
    def forward(probs: torch.Tensor, grads: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """``grads (..., T, heads * head_dim) -> (..., T, kv_heads * head_dim)``, the leading dimensions as rows."""
        rows = grads.reshape(-1, *grads.shape[-2:])
        return value_gradients(probs, rows, heads, kv_heads).reshape(*grads.shape[:-1], -1)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        """Nothing to keep: the result is not differentiated again."""

    @staticmethod
    def vmap(info: Any, in_dims: Any, probs: torch.Tensor, grads: torch.Tensor, heads: int, kv_heads: int) -> Any:
        """The batched rows as leading rows of one product (rows with their own probabilities: one product each)."""
        probs_dim, grads_dim = in_dims[0], in_dims[1]
        if grads_dim is not None:
            grads = grads.movedim(grads_dim, 0)
        if probs_dim is None:
            return _ValueGradients.apply(probs, grads, heads, kv_heads), None if grads_dim is None else 0
        probs = probs.movedim(probs_dim, 0)
        each = [grads[i] if grads_dim is not None else grads for i in range(info.batch_size)]
        return torch.stack([_ValueGradients.apply(p, g, heads, kv_heads) for p, g in zip(probs, each, strict=True)]), 0


class _HeldMix(torch.autograd.Function):
    """The model's mixed values ``mixed`` as they are; their gradient reaches ``values`` as ``P^T @ grad``."""

    @staticmethod
    def forward(
        mixed: torch.Tensor, values: torch.Tensor, probs: torch.Tensor, heads: int, kv_heads: int
    ) -> torch.Tensor:  # type: ignore[override,unused-ignore]
        """The mixed values ``(1, T, heads * head_dim)`` (a copy)."""
        return mixed.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        """Keep the probabilities and the head counts."""
        _, _, probs, heads, kv_heads = inputs
        ctx.save_for_backward(probs)
        ctx.heads, ctx.kv_heads = heads, kv_heads

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        """Only ``values`` gets a gradient."""
        (probs,) = ctx.saved_tensors
        return None, _ValueGradients.apply(probs, grad, ctx.heads, ctx.kv_heads), None, None, None


def batched_attention(group: HookGroup, model: nn.Module, layout: LMLayout) -> set[int]:
    """Hooks that write each layer's frozen attention again through :class:`_HeldMix`.

    Returns the set the forward fills with the layers written again (the others fail the check of the module
    documentation and keep the model's backward).
    """
    heads, kv_heads, dim = layout.n_heads, layout.n_kv_heads, layout.head_dim
    layers: dict[str, int] = {}
    values: dict[str, int] = {}
    for layer in layout.layers:
        attention = layer.attention
        if attention.v is not None:
            values[attention.v] = layer.index
        elif attention.qkv is not None and attention.qkv_order == "blocks":
            values[attention.qkv] = layer.index
        else:
            continue
        layers[attention.module] = layer.index
    seen: dict[int, torch.Tensor] = {}
    mixed: dict[int, torch.Tensor] = {}
    done: set[int] = set()
    outs = {layout.layers[i].attention.out_proj: i for i in layers.values()}

    def value(module: nn.Module, args: Any, output: torch.Tensor, *, name: str) -> None:
        seen[values[name]] = output[..., -kv_heads * dim :]  # a fused projection: its last block

    def mix(x: torch.Tensor, name: str, call: int) -> None:
        mixed[outs[name]] = x

    def attend(module: nn.Module, args: Any, output: Any, *, name: str) -> Any:
        index = layers[name]
        v, x = seen.pop(index, None), mixed.pop(index, None)
        if not isinstance(output, tuple) or len(output) < 2 or v is None or x is None:
            return None
        out = _rewritten(model, layout.layers[index].attention.out_proj, output[0], output[1], v, x, (heads, kv_heads))
        if out is None:
            return None
        done.add(index)
        return (output[0].detach() + (out - out.detach()), *output[1:])

    if layers:
        group.forward(list(values), value)
        hook_site(group, list(outs), "input", None, mix)
        group.forward(list(layers), attend)
    return done


def _rewritten(
    model: nn.Module, out_proj: str, y: torch.Tensor, probs: Any, v: torch.Tensor, x: torch.Tensor,
    heads: tuple[int, int],
) -> torch.Tensor | None:  # fmt: skip
    """``out_proj(_HeldMix(x, v, probs))``, or ``None`` where ``P @ V`` is not ``x`` or ``out_proj(x)`` not ``y``."""
    n, kv = heads
    if not isinstance(probs, torch.Tensor) or probs.dim() != 4 or probs.shape[:2] != (1, n) or v.dim() != 3:
        return None
    positions = v.shape[1]
    if probs.shape[-2:] != (positions, positions) or x.shape != (1, positions, v.shape[-1] * n // kv):
        return None
    expected = _mixed(probs.detach(), v.detach(), n, kv)
    w, b = linear(model.get_submodule(out_proj), device=x.device)
    w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
    rtol, atol = (1e-9, 1e-12) if x.dtype == torch.float64 else (1e-4, 1e-5)
    if not torch.allclose(expected, x.detach(), rtol, atol):
        return None
    out = F.linear(_HeldMix.apply(x.detach(), v, probs.detach(), n, kv), w, b)
    if out.shape != y.shape or not torch.allclose(out.detach(), y.detach(), rtol, atol):
        return None
    return out


def _mixed(probs: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """``(1, T, heads * head_dim)``: each head's ``P @ V`` (its key/value head's values), heads side by side."""
    positions = v.shape[1]
    per_head = v.reshape(1, positions, kv_heads, -1).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    return (probs.to(v.dtype) @ per_head).transpose(1, 2).reshape(1, positions, -1)
