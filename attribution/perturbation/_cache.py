"""Keys/values of a causal language model's unperturbed prefix, reused by every perturbation that starts later.

Whether a model takes a cache, and under which keyword, is read by :func:`attribution.models.cache_keyword`.
"""

from __future__ import annotations

import copy
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
    """Split perturbations sorted by first change into runs ``[first, stop)`` of at most ``most``, cheapest overall.

    A run from ``first`` costs one call (counted as one more row of ``length`` tokens) plus its rows times the
    positions they run, ``length - starts[first]``; dynamic programming over the split points finds the cheapest.

    Example:
        >>> prefix_groups([0, 0, 6, 7, 7, 7], 8, 4)
        [(0, 2), (2, 6)]
    """
    count = len(starts)
    best = [0.0] + [float("inf")] * count
    cut = [0] * (count + 1)
    for stop in range(1, count + 1):
        for first in range(max(0, stop - most), stop):
            cost = best[first] + length + (stop - first) * (length - starts[first])
            if cost < best[stop]:
                best[stop], cut[stop] = cost, first
    runs = []
    stop = count
    while stop > 0:
        runs.append((cut[stop], stop))
        stop = cut[stop]
    return runs[::-1]


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
