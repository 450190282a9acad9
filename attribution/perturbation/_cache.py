"""Keys/values of a causal language model's unperturbed prefix, reused by every perturbation that starts later.

Whether a model takes a cache, and under which keyword, is read by :func:`attribution.models.cache_keyword`.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch


def returned_cache(output: Any, keyword: str) -> Any:
    """The keys/values a forward returned (under ``keyword``, or the other spelling)."""
    for name in (keyword, "past_key_values", "cache"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


def usable_cache(cache: Any, length: int) -> bool:
    """Whether a returned cache can be cropped and repeated over a batch (a full-attention ``DynamicCache``)."""
    needed = ("crop", "batch_repeat_interleave", "get_seq_length")
    if cache is None or not all(hasattr(cache, name) for name in needed):
        return False
    if getattr(cache, "is_sliding", None) and any(cache.is_sliding):  # sliding layers drop keys: not croppable
        return False
    return bool(getattr(cache, "is_croppable", True)) and int(cache.get_seq_length()) == length


def prefix_cache(cache: Any, length: int, repeats: int) -> Any:
    """A copy of ``cache`` cut to its first ``length`` positions, each batch row repeated ``repeats`` times in a row."""
    copied = copy.deepcopy(cache)
    extra = int(copied.get_seq_length()) - length
    if extra > 0:
        copied.crop(-extra)  # transformers 5.2x: a negative count removes that many positions from the end
    if repeats > 1:
        copied.batch_repeat_interleave(repeats)
    return copied


def prefix_groups(starts: list[int], length: int, most: int) -> list[tuple[int, int]]:
    """Cut perturbations sorted by first change into ``ceil(count / most)`` runs of ``<= most``, fewest positions.

    ``ceil(count / most)`` is the number of model calls without reuse. A run from ``first`` runs its rows on positions
    ``starts[first] .. length - 1``. More, smaller runs could run fewer positions still, but each model call has a
    cost of its own (the forward's operations, each a parallel region of the CPU threads) that grows without bound on
    a loaded machine: holding the number of calls keeps reuse from ever being slower than the plain re-run. Run ``r``
    ends between ``count - (R - r) most`` and ``r most`` (``R`` runs), so dynamic programming over those boundaries
    is ``O(R s^2)`` for a slack ``s = R most - count``.

    Example:
        >>> prefix_groups([0, 0, 6, 7, 7, 7], 8, 4)
        [(0, 2), (2, 6)]
    """
    count = len(starts)
    if count == 0:
        return []
    runs = -(-count // most)
    best: list[dict[int, tuple[int, int]]] = [{0: (0, 0)}]  # per run: boundary -> (positions so far, previous)
    for r in range(1, runs + 1):
        layer: dict[int, tuple[int, int]] = {}
        for stop in range(max(count - (runs - r) * most, r), min(r * most, count) + 1):
            for first, (cost, _) in best[-1].items():
                if 0 < stop - first <= most:
                    total = cost + (stop - first) * (length - starts[first])
                    if stop not in layer or total < layer[stop][0]:
                        layer[stop] = (total, first)
        best.append(layer)
    bounds = [count]
    for layer in reversed(best[1:]):
        bounds.append(layer[bounds[-1]][1])
    bounds.reverse()
    return list(itertools.pairwise(bounds))


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
