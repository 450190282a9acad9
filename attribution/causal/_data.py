"""What training and scoring draw from: the sources' site activations and the base's prefix, recorded once.

For several sites at once (a sweep), the sources run once with every site recorded, and the base's prefix is
recorded once per distinct first intervened position; each site then gets its own :class:`Batches` (its suffix's
source activations, the shared prefix) and its site resolved against the suffix's positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..patching.sites import record
from ._prefix import Prefix, first_position, record_prefix, shifted
from .site import Resolved


@dataclass(frozen=True)
class Batches:
    """What every training step or scoring batch draws its rows from."""

    base: Any
    source_acts: torch.Tensor
    labels: torch.Tensor
    prefix: Prefix | None

    def run(self, model: nn.Module, rows: torch.Tensor) -> Any:
        """The model on the chosen base rows (their suffix, where the prefix is cached)."""
        if self.prefix is not None:
            return self.prefix.run(model, self.base, rows)
        return run(model, rows_of(self.base, rows))


def prepare(
    model: nn.Module, base: Any, sources: Any, labels: torch.Tensor, resolved: list[Resolved], batch_size: int
) -> dict[Resolved, tuple[Resolved, Batches]]:
    """For each resolved site: the site as the steps see it (positions shifted past a prefix) and its batches."""
    acts = site_activations(model, sources, resolved, batch_size)
    prefixes: dict[int, Prefix | None] = {}
    prepared = {}
    for r in resolved:
        start = first_position(r.site.positions, base.shape[1]) if isinstance(base, torch.Tensor) else 0
        if start not in prefixes:
            prefixes[start] = record_prefix(model, base, r, batch_size)
        prefix = prefixes[start]
        seen, source = r, acts[r]
        if prefix is not None:  # every step runs only the suffix after the first intervened position
            seen, source = shifted(r, prefix.length, base.shape[1]), source[:, prefix.length :]
        prepared[r] = (seen, Batches(base, source, labels, prefix))
    return prepared


def site_activations(
    model: nn.Module, sources: Any, resolved: list[Resolved], batch_size: int
) -> dict[Resolved, torch.Tensor]:
    """The sources' whole activations at every site, recorded in one pass of batches without autograd."""
    groups: dict[tuple[Literal["output", "input"], Any], list[Resolved]] = {}
    for r in resolved:
        groups.setdefault((r.site.site, r.site.element), []).append(r)
    parts: dict[Resolved, list[torch.Tensor]] = {r: [] for r in resolved}
    n = len(next(iter(sources.values())) if isinstance(sources, Mapping) else sources)
    with ExitStack() as stack, torch.no_grad():
        recorders = [
            (stack.enter_context(record(model, sorted({r.name for r in rs}), site=kind, element=element)), rs)
            for (kind, element), rs in groups.items()
        ]
        for i in range(0, n, batch_size):
            run(model, rows_of(sources, slice(i, i + batch_size)))
            for acts, rs in recorders:
                for r in rs:
                    parts[r].append(acts[r.name])
    return {r: torch.cat(found) for r, found in parts.items()}


def rows_of(inputs: Any, rows: torch.Tensor | slice) -> Any:
    """The chosen rows of a tensor or of each tensor of a dict."""
    if isinstance(inputs, Mapping):
        return {k: v[rows] for k, v in inputs.items()}
    return inputs[rows]


def run(model: nn.Module, inputs: Any) -> Any:
    """The model on a tensor or on a dict of keyword inputs."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
