"""The activations CAVs are fitted to: every example set run once, each layer's output flattened to one row per example.

The sets are run in batches (:func:`attribution.probes._record.batches`: a tensor, a mapping of tensors or an
iterable of batches) through one :class:`~attribution._run.HookedRun` without autograd; the rows stay on the model's
device, in the layer's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hooks import resolve

from .._inputs import batches
from .._run import HookedRun, SiteTypeError, SiteValueError, eager_module


def layer_names(model: nn.Module, layers: Any, *, what: str, one: bool = False) -> list[str]:
    """The module names ``layers`` resolve to (names, globs or modules); with ``one``, exactly one module."""
    names = [name for name, _ in resolve(eager_module(model), layers, what=what)]
    if one and len(names) != 1:
        shown = ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(
            f"{what} {layers!r} matches {len(names)} modules ({shown}); a CAV lives in one layer: name one"
        )
    return names


def activation(output: Any, name: str, call: int) -> torch.Tensor:
    """A layer's output as CAVs use it: one floating-point tensor ``(batch, ...)`` from the layer's only call."""
    if call > 0:
        raise SiteValueError(
            f"`layers` {name!r} ran more than once in one forward, so its activation is not one vector per example: "
            "choose a module that runs once (see hooks.trace(model, inputs))"
        )
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.dim() < 2:
        got = (
            f"a {output.dtype} tensor of shape {tuple(output.shape)}"
            if isinstance(output, torch.Tensor)
            else (f"a {type(output).__name__}")
        )
        raise SiteTypeError(
            f"`layers` {name!r} returned {got}; CAVs live in a floating-point output (batch, ...): name a submodule "
            "that returns one"
        )
    return output


def record_sets(
    model: nn.Module, sets: Sequence[Any], labels: Sequence[str], names: Sequence[str], *, batch_size: int
) -> tuple[list[dict[str, torch.Tensor]], dict[str, tuple[int, ...]]]:
    """Each set's activations ``(examples, features)`` per layer, and each layer's activation shape per example.

    Checked: two examples or more per set, one activation shape per layer across the sets.
    """
    found: list[dict[str, torch.Tensor]] = []
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    kept: dict[str, list[torch.Tensor]] = {}

    def keep(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
        kept[name].append(activation(output, name, call).detach())

    with HookedRun(eager_module(model), "concepts") as run:
        run.group.forward(list(names), keep)
        for examples, label in zip(sets, labels, strict=True):
            kept.clear()
            kept.update({name: [] for name in names})
            for batch in batches(examples, batch_size):
                run.forward(batch)
            found.append({name: _rows(kept[name], name, label, shapes) for name in names})
    return found, {name: shape for name, (shape, _) in shapes.items()}


def _rows(
    chunks: list[torch.Tensor], name: str, label: str, shapes: dict[str, tuple[tuple[int, ...], str]]
) -> torch.Tensor:
    """One set's activations at one layer as rows, checked against the sets seen before."""
    if not chunks:
        raise ValueError(f"{label} gave no activations at layer {name!r}: give at least two examples")
    acts = torch.cat(chunks)
    if len(acts) < 2:
        raise ValueError(
            f"{label} holds {len(acts)} example; a CAV separates two sets of examples and needs at least two in each "
            "(tens are usual): add examples"
        )
    shape = tuple(acts.shape[1:])
    first = shapes.setdefault(name, (shape, label))
    if first[0] != shape:
        raise ValueError(
            f"{label} gives activations of shape {shape} per example at layer {name!r}, but {first[1]} gives "
            f"{first[0]}: every example set (and the inputs explained) must hold inputs of one shape; resize them"
        )
    return acts.flatten(1)
