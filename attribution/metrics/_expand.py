"""Inputs repeated for perturbed copies, and targets that follow them: what infidelity and sensitivity share.

A chunk holds ``k`` copies of each of the ``B`` items, item-major (copy ``j`` of item ``i`` is row ``i * k + j``, as
``torch.repeat_interleave`` makes them and as captum lays them out), so that a perturbation function given the same
generator draws the same numbers here and in captum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hooks import map_tensors

from .._run import describe
from ..targets import Target, check_target, target_indices, target_scores

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


def repeat(parts: Tensors, k: int) -> Tensors:
    """Every tensor with each item repeated ``k`` times, item-major: ``(B, ...) -> (B * k, ...)``."""
    return tuple(p.repeat_interleave(k, dim=0) for p in parts)


def expand_target(target: Target, batch: int, k: int) -> Target:
    """The target of ``batch * k`` item-major copies: classes repeated, a callable given groups of ``batch`` rows.

    ``None`` and one class stay as they are; one class per item is repeated ``k`` times each; a callable target is
    wrapped so that it sees the output of ``batch`` copies at a time, one of each item in batch order (as the other
    metrics give it), which keeps targets that hold one class or mask per item right.
    """
    check_target(target, batch)
    if target is None or k == 1:
        return target
    if callable(target):
        return _Grouped(target, batch, k)
    index = target_indices(target, "`target`")
    assert index is not None
    return index if index.dim() == 0 else index.repeat_interleave(k)


class _Grouped:
    """A callable target applied to ``k`` groups of ``batch`` rows of an item-major output of ``batch * k`` rows."""

    def __init__(self, target: Callable[[Any], torch.Tensor], batch: int, k: int) -> None:
        self.target, self.batch, self.k = target, batch, k

    def __call__(self, output: Any) -> torch.Tensor:
        """Scores ``(batch * k,)`` in the output's row order."""
        rows, scores = self.batch * self.k, []
        for j in range(self.k):
            picked = torch.arange(self.batch) * self.k + j

            def group(value: Any, picked: torch.Tensor = picked) -> Any:
                per_row = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows
                return value[picked.to(value.device)] if per_row else value

            scores.append(target_scores(map_tensors(group, output), self.target, self.batch))
        return torch.stack(scores, dim=1).reshape(rows)
