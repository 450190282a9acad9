"""The attacks' inputs: a tensor or a tuple of floating-point tensors sharing a batch axis, and back.

The same checks as ``attribution/metrics/_expand.py`` (infidelity and sensitivity), kept here because a family
imports no private name of another; both could move to the kernel (``attribution/_inputs.py``) together.
"""

from __future__ import annotations

from typing import Any

import torch

from .._run import describe

Tensors = tuple[torch.Tensor, ...]


def as_tensors(value: Any, what: str) -> Tensors:
    """A tensor, or a tuple or list of tensors, as a tuple of tensors; anything else is a ``TypeError``."""
    parts = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError(
            f"{what} must be a tensor (batch, ...) or a tuple of such tensors (one per model input); got "
            f"{describe(value)}"
        )
    return parts


def check_inputs(inputs: Any) -> Tensors:
    """The model inputs as a tuple of floating-point tensors sharing a non-empty batch axis."""
    parts = as_tensors(inputs, "`inputs`")
    for i, part in enumerate(parts):
        if part.dim() == 0 or not part.is_floating_point():
            raise TypeError(
                f"`inputs` must be floating-point tensors with a batch axis, to be perturbed; input {i} is "
                f"{describe(part)}: convert it with .float(), or close over inputs that are not perturbed in `model`"
            )
    batch = parts[0].shape[0]
    if batch == 0 or any(p.shape[0] != batch for p in parts):
        raise ValueError(
            f"`inputs` must share one non-empty batch axis; got {describe(inputs)}: give every tensor the same "
            "first axis"
        )
    return parts


def as_given(parts: Tensors, single: bool) -> Any:
    """The tensors in the form the user gave them: the tensor itself, or the tuple."""
    return parts[0] if single else parts
