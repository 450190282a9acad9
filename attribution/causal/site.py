"""Where an intervention acts: :class:`Site` (a module's input or output, positions, heads) and the pure slicing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hooks import resolve

from .._run import Element
from ..models import heads_at, lm_layout
from ..patching.sites import check_site


@dataclass(frozen=True)
class Site:
    """One site of a model, spelled as the patching family spells it; hashable, a key of ``interventions``.

    Args:
        module: a module name (or glob matching exactly one module), or the module itself.
        positions: positions along the sequence axis (axis 1) to intervene on; ``None``: the whole activation.
        site: the module's ``"output"`` or its ``"input"`` (see :mod:`attribution.patching`).
        element: for tuple, mapping or ``ModelOutput`` outputs, which tensor; for ``site="input"``, which argument.
        heads: head indices at an attention output projection's input (the head count is read from the model's
            config); the intervention then acts on the chosen heads' coordinates, concatenated.

    Example:
        >>> Site("model.layers.1", positions=[3, 4])
        Site(module='model.layers.1', positions=(3, 4), site='output', element=None, heads=None)
    """

    module: str | nn.Module
    positions: tuple[int, ...] | None = None
    site: Literal["output", "input"] = "output"
    element: Element = None
    heads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_site(self.site)
        for field, value in (("positions", self.positions), ("heads", self.heads)):
            if value is None:
                continue
            if isinstance(value, int | str) or not isinstance(value, Sequence | torch.Tensor):
                raise TypeError(f"`{field}` must be a sequence of ints (e.g. [3, 4]) or None; got {value!r}")
            object.__setattr__(self, field, tuple(int(v) for v in value))


@dataclass(frozen=True)
class Resolved:
    """A :class:`Site` resolved against one model: its module's name and its head count (0 without heads)."""

    site: Site
    name: str
    n_heads: int


def resolve_site(model: nn.Module, site: Any) -> Resolved:
    """Check ``site`` against ``model``: exactly one module, and a head count where ``heads`` are asked for."""
    if not isinstance(site, Site):
        raise TypeError(f"an intervention's key must be a Site (e.g. Site('model.layers.1')); got {site!r}")
    found = resolve(model, site.module, what="`Site.module`")
    if len(found) != 1:
        names = [name for name, _ in found]
        raise ValueError(f"`Site.module` {site.module!r} must match one module; it matches {len(found)}: {names[:5]}")
    name = found[0][0]
    if site.heads is None:
        return Resolved(site, name, 0)
    known = heads_at(lm_layout(model), name, site.site)
    if known is None:
        raise ValueError(
            f"`heads` needs a site that holds heads (an attention output projection's input, site='input', or a "
            f"query projection's output); {name!r} with site={site.site!r} does not"
        )
    bad = [h for h in site.heads if not 0 <= h < known[0]]
    if bad:
        raise ValueError(f"`heads` {bad} out of range: {name!r} holds {known[1]}")
    return Resolved(site, name, known[0])


def gather(
    activation: torch.Tensor, positions: tuple[int, ...] | None, heads: tuple[int, ...] | None, n_heads: int
) -> torch.Tensor:
    """The intervened part: ``(batch, [positions,] width)``, heads' coordinates concatenated on the last axis."""
    part = activation if positions is None else activation[:, list(positions)]
    if heads is None:
        return part
    split = part.unflatten(-1, (n_heads, part.shape[-1] // n_heads))[..., list(heads), :]
    return split.flatten(-2)


def scatter(
    activation: torch.Tensor,
    values: torch.Tensor,
    positions: tuple[int, ...] | None,
    heads: tuple[int, ...] | None,
    n_heads: int,
) -> torch.Tensor:
    """A copy of ``activation`` with the part :func:`gather` reads replaced by ``values`` (differentiable)."""
    new = activation.clone()
    rows = slice(None) if positions is None else list(positions)
    if heads is None:
        if positions is None:
            return values.to(activation.dtype)
        new[:, rows] = values.to(new.dtype)
        return new
    view = new.unflatten(-1, (n_heads, new.shape[-1] // n_heads))  # a view of ``new``: writes land in it
    part = values.unflatten(-1, (len(heads), view.shape[-1])).to(new.dtype)
    if positions is None:
        view[..., list(heads), :] = part
    else:
        block = view[:, rows]
        block[..., list(heads), :] = part
        view[:, rows] = block
    return new
