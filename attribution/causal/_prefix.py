"""The base prompts' prefix before the first intervened position: run once, its keys/values reused by every step.

An intervention at positions ``p >= p0`` of a causal language model cannot change what the model computes at the
positions before ``p0``, so training runs only the suffix ``base[:, p0:]`` on the prefix's cached keys and values.
Used when the base is a tensor of token ids, the model takes a key/value cache (read through the models reader) and
returns a full-attention ``DynamicCache``, and the site names its positions; otherwise every step runs the whole base.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._kv import returned_cache, usable_cache
from ..models import cache_keyword
from .site import Resolved


@dataclass
class Prefix:
    """Every base row's keys and values of its first ``length`` positions, per layer (``(n, heads, length, d)``)."""

    length: int
    keyword: str
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def cache(self, rows: torch.Tensor) -> Any:
        """A fresh ``DynamicCache`` holding the chosen rows' prefix (the forward appends to it)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.layers):
            cache.update(keys[rows], values[rows], index)
        return cache

    def run(self, model: nn.Module, base: torch.Tensor, rows: torch.Tensor) -> Any:
        """The model on the chosen rows' suffix after the prefix."""
        return model(base[rows, self.length :], **{self.keyword: self.cache(rows)})


def first_position(positions: tuple[int, ...] | None, length: int) -> int:
    """The smallest intervened position counted from the start (0 when all positions are intervened)."""
    if positions is None:
        return 0
    return min(p % length for p in positions)


def shifted(r: Resolved, start: int, length: int) -> Resolved:
    """``r`` with its positions counted from ``start`` (the suffix's own positions)."""
    assert r.site.positions is not None
    moved = tuple(p % length - start for p in r.site.positions)
    return dataclasses.replace(r, site=dataclasses.replace(r.site, positions=moved))


def record_prefix(model: nn.Module, base: Any, r: Resolved, batch_size: int) -> Prefix | None:
    """The base rows' prefix before ``r``'s first position, or ``None`` where it cannot be reused."""
    keyword = cache_keyword(model)
    if keyword is None or not isinstance(base, torch.Tensor) or base.dim() != 2 or base.is_floating_point():
        return None
    start = first_position(r.site.positions, base.shape[1])
    if start == 0:
        return None
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    with torch.no_grad():
        for i in range(0, len(base), batch_size):
            cache = returned_cache(model(base[i : i + batch_size, :start], use_cache=True), keyword)
            if not usable_cache(cache, start) or not hasattr(cache, "layers"):
                return None
            parts.append([(layer.keys, layer.values) for layer in cache.layers])
    layers = [(torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts])) for i in range(len(parts[0]))]
    return Prefix(start, keyword, layers)
