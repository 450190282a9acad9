"""The logit effects of units: each unit's output direction read through the final norm and the unembedding."""

from __future__ import annotations

import torch
from torch import nn

from ..models import linear, lm_layout, norm_affine
from .units import Bound

KEPT = 20
"""Top and bottom tokens kept per unit."""


def effects(model: nn.Module, bound: list[Bound]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """``(writes, logits)``: the units' output directions ``(units, d_model)`` and their top/bottom logit effects.

    A direction ``w`` raises the logits by ``W_U (gain * centre(w))`` with the final norm's scale left out, as the
    logit lens reads a residual direction (``centre`` subtracts the mean for a LayerNorm), in float32 (one
    ``(units, vocabulary)`` product in chunks: 6 s for 6,144 units and SmolLM2's 49,152 tokens). ``logits`` is ``None``
    where the directions are not in the residual stream or the model has no final norm and unembedding to read.
    """
    if any(b.writes is None for b in bound):
        return None, None
    writes = torch.cat([b.writes for b in bound if b.writes is not None])
    try:
        layout = lm_layout(model)
    except ValueError:
        return writes, None
    if layout.unembed is None or writes.shape[1] != layout.hidden:
        return writes, None
    norm = norm_affine(model.get_submodule(layout.final_norm), torch.randn(4, layout.hidden))
    unembed = linear(model.get_submodule(layout.unembed), device=torch.device("cpu"))[0].detach().float()
    return writes, top_and_bottom(norm.gain.float().cpu() * norm.centre(writes.float()), unembed, KEPT)


def top_and_bottom(directions: torch.Tensor, unembed: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Each direction's ``k`` largest and smallest logits ``directions @ unembed.T``, in chunks of units.

    Example:
        >>> out = top_and_bottom(torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [-1.0, 0.0], [0.5, 9.0]]), 1)
        >>> out["top_ids"].tolist(), out["bottom_ids"].tolist(), out["bottom_values"].tolist()
        ([[0]], [[1]], [[-1.0]])
    """
    k = min(k, unembed.shape[0])
    parts: dict[str, list[torch.Tensor]] = {"top_ids": [], "top_values": [], "bottom_ids": [], "bottom_values": []}
    for chunk in directions.split(256):
        logits = chunk @ unembed.T
        top, bottom = logits.topk(k, dim=1), logits.topk(k, dim=1, largest=False)
        parts["top_ids"].append(top.indices)
        parts["top_values"].append(top.values.float())
        parts["bottom_ids"].append(bottom.indices)
        parts["bottom_values"].append(bottom.values.float())
    return {name: torch.cat(chunks) for name, chunks in parts.items()}
