"""Keys/values of a causal language model's unperturbed prefix, reused by every perturbation that starts later.

Whether a model takes a cache, and under which keyword, is read by :func:`attribution.models.cache_keyword`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch


def prefix_cache(cache: Any, length: int, repeats: int) -> Any:
    """A copy of ``cache`` cut to its first ``length`` positions, each batch row repeated ``repeats`` times in a row."""
    copied = copy.deepcopy(cache)
    extra = int(copied.get_seq_length()) - length
    if extra > 0:
        copied.crop(-extra)  # transformers 5.2x: a negative count removes that many positions from the end
    if repeats > 1:
        copied.batch_repeat_interleave(repeats)
    return copied


def prefix_groups(starts: list[int], length: int, most: Callable[[int], int], call: float) -> list[tuple[int, int]]:
    """Cut perturbations sorted by first change into runs that cost the least: ``call`` per run plus its positions.

    A run ``first .. stop - 1`` runs its rows on positions ``starts[first] .. length - 1`` and costs
    ``call + (stop - first) * (length - starts[first])`` (``call``: a model call's own cost, counted in positions,
    such as reading every weight once). ``most(width)`` is the most perturbations one run of ``width`` positions may
    hold (runs that start later are shorter, so they may hold more rows). Dynamic programming over the run ends is
    exact and ``O(count * most)``.

    Example:
        >>> prefix_groups([0, 0, 6, 7, 7, 7], 8, lambda width: 4, 0.0)   # calls free: one run per start
        [(0, 2), (2, 3), (3, 6)]
        >>> prefix_groups([0, 0, 6, 7, 7, 7], 8, lambda width: 4, 100.0)   # the fewest calls, then positions
        [(0, 2), (2, 6)]
        >>> prefix_groups([0, 0, 6, 7, 7, 7], 8, lambda width: 1 if width > 2 else 8, 100.0)
        [(0, 1), (1, 2), (2, 6)]
    """
    count = len(starts)
    best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * count  # per run end: (cost so far, run start)
    for first in range(count):
        width = length - starts[first]
        for stop in range(first + 1, min(count, first + max(1, most(width))) + 1):
            cost = best[first][0] + call + (stop - first) * width
            if cost < best[stop][0]:
                best[stop] = (cost, first)
    runs: list[tuple[int, int]] = []
    stop = count
    while stop > 0:
        runs.insert(0, (best[stop][1], stop))
        stop = best[stop][1]
    return runs


def first_changes(perturbed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per perturbation, the first position whose token differs from ``x`` in any item (``T`` where none does).

    ``perturbed`` is ``(batch, P, T)``, ``x`` is ``(batch, T)``; returns ``(P,)``.

    Example:
        >>> first_changes(torch.tensor([[[1, 2, 3], [1, 0, 0], [1, 2, 3]]]), torch.tensor([[1, 2, 3]]))
        tensor([3, 1, 3])
    """
    changed = (perturbed != x[:, None]).any(0)  # (P, T)
    length = x.shape[-1]
    position = torch.where(changed, torch.arange(length, device=x.device), length)
    return position.min(-1).values
