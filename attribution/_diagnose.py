"""Causes of degenerate results, found cheaply, for warnings that say why and what to do."""

from __future__ import annotations

import torch
from torch import nn


def items(indices: list[int]) -> str:
    """``item 3`` or ``items [0, 2, ...]`` for a message."""
    if len(indices) == 1:
        return f"item {indices[0]}"
    return f"items {indices[:8]}" + ("..." if len(indices) > 8 else "")


def output_ignores_input(model: nn.Module) -> bool:
    """Whether the model's last layer with weights has all-zero weights (its output is then a constant)."""
    last = [m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    weight = last[-1].weight if last else None
    return isinstance(weight, torch.Tensor) and weight.numel() > 0 and not bool(weight.detach().any())


ZERO_HEAD = (
    "The model's output does not depend on its input: its last layer has all-zero weights (as torchvision's ViTs "
    "have with weights=None, whose head is zero-initialised). Load trained weights, or initialise the head (e.g. "
    "nn.init.normal_(head.weight, std=0.01)) to test a pipeline"
)
