"""Rollout arithmetic: pure functions of attention maps ``(batch, heads, tokens, tokens)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Fusion = Literal["mean", "max", "min"]


def fuse_heads(attention: torch.Tensor, fusion: Fusion = "mean") -> torch.Tensor:
    """Fuse the heads of ``(batch, heads, T, T)`` attention into ``(batch, T, T)`` by mean, max or min."""
    if fusion == "mean":
        return attention.mean(dim=1)
    if fusion == "max":
        return attention.amax(dim=1)
    if fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"`head_fusion` must be 'mean', 'max' or 'min'; got {fusion!r}")


def discard_lowest(fused: torch.Tensor, ratio: float) -> torch.Tensor:
    """Zero, per sample, the ``floor(ratio * T * T)`` lowest entries of ``(batch, T, T)``, except in column 0.

    The entries are ranked over the whole ``T x T`` matrix; those of the class token's column (column 0) are kept
    even when they rank among the lowest, so the number actually zeroed can be smaller than ``ratio * T * T``.
    """
    if ratio == 0:
        return fused
    b, t, _ = fused.shape
    count = int(t * t * ratio)
    if count == 0:
        return fused
    flat = fused.reshape(b, t * t)
    kth = flat.kthvalue(count, dim=1, keepdim=True).values  # a selection, much cheaper than topk for large counts
    below, ties = flat < kth, flat == kth
    room = count - below.sum(dim=1, keepdim=True)  # entries equal to the k-th value that still belong to the k lowest
    drop = below | (ties & (ties.cumsum(dim=1) <= room))
    drop &= torch.arange(t * t, device=flat.device) % t != 0  # never the class token's column
    return flat.masked_fill(drop, 0).view(b, t, t)


def attention_rollout(
    attentions: Sequence[torch.Tensor],
    *,
    head_fusion: Fusion = "mean",
    discard_ratio: float = 0.0,
    row: int | None = None,
) -> torch.Tensor:
    """The rollout ``(batch, T, T)`` of per-layer attentions ``(batch, heads, T, T)``, first layer first.

    Per layer: heads fused, the lowest entries discarded (:func:`discard_lowest`), ``A_hat = 0.5 A + 0.5 I`` with
    rows renormalised to sum to 1; then ``R = A_hat_L ... A_hat_2 A_hat_1`` (later layers on the left). Every row
    of ``R`` sums to 1. With ``row=i`` only row ``i`` is computed, ``(batch, T)``, by vector-matrix products (L
    times cheaper than the matrix products).

    Example:
        >>> eye = torch.eye(5).expand(2, 3, 5, 5)   # identity attention: 2 items, 3 heads
        >>> torch.equal(attention_rollout([eye, eye]), torch.eye(5).expand(2, 5, 5))
        True
    """
    check_options(head_fusion, discard_ratio)
    steps = [_residual_step(discard_lowest(fuse_heads(a, head_fusion), discard_ratio)) for a in attentions]
    if not steps:
        raise ValueError("`attentions` is empty: rollout needs at least one layer")
    return _chain(steps, row)


def _chain(steps: list[torch.Tensor], row: int | None) -> torch.Tensor:
    """``M_L ... M_1`` for per-layer ``(batch, T, T)`` matrices (first layer first), or only its row ``row``."""
    if row is None:
        result = steps[0]
        for step in steps[1:]:
            result = step @ result
        return result
    vector = steps[-1][:, row]  # e_row^T M_L, then times M_(L-1) ... M_1
    for step in reversed(steps[:-1]):
        vector = (vector[:, None] @ step)[:, 0]
    return vector


def _residual_step(fused: torch.Tensor) -> torch.Tensor:
    """``0.5 A + 0.5 I`` with rows renormalised, computed as ``(A + I) / rowsum(A + I)`` (the same matrix)."""
    a_hat = fused.clone()
    a_hat.diagonal(dim1=-2, dim2=-1).add_(1)
    return a_hat.div_(a_hat.sum(dim=-1, keepdim=True))


def gradient_rollout(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], *, row: int | None = None
) -> torch.Tensor:
    """Chefer et al. 2021 (https://arxiv.org/abs/2103.15679), ``(batch, T, T)`` (or its row ``row``, ``(batch, T)``).

    ``A_bar = mean_heads((dS/dA * A)^+)`` per layer; ``R = I``, then ``R = R + A_bar R`` layer by layer, first
    layer first; that is ``R = (I + A_bar_L) ... (I + A_bar_1)``.
    """
    if len(attentions) != len(gradients) or not attentions:
        raise ValueError(
            f"need as many gradients as attentions (at least one); got {len(attentions)} and {len(gradients)}"
        )
    t = attentions[0].shape[-1]
    eye = torch.eye(t, dtype=attentions[0].dtype, device=attentions[0].device)
    steps = [eye + (g * a).clamp(min=0).mean(dim=1) for a, g in zip(attentions, gradients, strict=True)]
    return _chain(steps, row)


def check_options(head_fusion: str, discard_ratio: float) -> None:
    if head_fusion not in ("mean", "max", "min"):
        raise ValueError(f"`head_fusion` must be 'mean', 'max' or 'min'; got {head_fusion!r}")
    if not isinstance(discard_ratio, (int, float)) or not 0 <= discard_ratio < 1:
        raise ValueError(
            f"`discard_ratio` must be a number in [0, 1) (the share of entries to zero); got {discard_ratio!r}"
        )
