"""Checks of the attention probabilities that rollout chains (found by :func:`attribution.models.find_attention`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._run import SiteValueError

MHA_ARGUMENTS = (
    "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal"
)  # the order of nn.MultiheadAttention.forward's parameters  # fmt: skip


def check_global(model: nn.Module, maps: list[torch.Tensor], names: list[str], batch: int) -> None:
    """Rollout chains attention over the same tokens in every layer: refuse windowed and changing token sets."""
    for probs, name in zip(maps, names, strict=True):
        if probs.shape[0] != batch:
            stage = _last_stage(model)
            raise ValueError(
                f"the attention of {name!r} is within windows: its attention is {tuple(probs.shape)} for a batch of "
                f"{batch} ({probs.shape[0] / batch:g} windows per image). Rollout needs global token attention, the "
                "same tokens attending to each other in every layer; windowed and hierarchical models (Swin, "
                "MaxViT, CoAtNet) do not have it. Explain them with a CAM at a stage output"
                + (f", e.g. GradCAM(model, {stage!r})" if stage else "")
            )
    sizes = [int(p.shape[-1]) for p in maps]
    if len(set(sizes)) > 1:
        last = [n for n, t in zip(names, sizes, strict=True) if t == sizes[-1]]
        raise ValueError(
            f"the attention maps change size between layers ({names[0]!r}: {sizes[0]} tokens, {names[-1]!r}: "
            f"{sizes[-1]} tokens; hierarchical stages, or a class token that joins late as in ConViT): rollout needs "
            f"every layer to attend over the same tokens. Pass `layers=` with the layers over the last {sizes[-1]} "
            f"tokens only: {list(dict.fromkeys(last))}"
        )


def _last_stage(model: nn.Module) -> str | None:
    """The last entry of a top-level ``stages``/``layers`` list (Swin, MaxViT, CoAtNet), if the model has one."""
    for list_name in ("stages", "layers"):
        stages = getattr(model, list_name, None)
        if isinstance(stages, (nn.ModuleList, nn.Sequential)) and len(stages) > 0:
            return f"{list_name}.{len(stages) - 1}"
    return None


def check_self_attention(probs: torch.Tensor, name: str) -> None:
    """Refuse attention from other queries than keys (cross-attention, CaiT's class attention)."""
    if probs.shape[-1] != probs.shape[-2]:
        raise SiteValueError(
            f"the attention of {name!r} maps {probs.shape[-2]} queries to {probs.shape[-1]} keys: it is not "
            "self-attention (an encoder-decoder's cross-attention, or a class-attention block where only the class "
            "token queries, as in CaiT). Rollout chains self-attention only: pass `layers=` with the "
            "self-attention modules (CaiT: layers='blocks.*.attn.attn_drop')"
        )


def probabilities(output: Any, name: str) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 4 and item.shape[-1] == item.shape[-2]:
                return item
    return output
