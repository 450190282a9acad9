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

from .._inputs import Tensors
from ..targets import Target, check_target, target_indices, target_scores


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
