"""Directions in activation space: add one (steering), project one out, find one as a difference of means."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookManager, resolve

from .._run import Element, HookedRun, SiteValueError, eager_if_compiled, eager_module, hook_site
from . import _math

Site = Literal["output", "input"]


@contextmanager
def steer(
    model: nn.Module,
    vectors: Mapping[str, torch.Tensor],
    *,
    scale: float = 1.0,
    positions: Sequence[int] | None = None,
    site: Site = "output",
    element: Element = None,
) -> Iterator[None]:
    """Add ``scale * vector`` to the activations of the sites inside the ``with`` block (activation steering).

    The vector is any direction of the site's last axis: a feature's decoder row (``sae.W_dec[i]``), a difference of
    means (:func:`diff_means`), ... It is added at every position, or with ``positions`` only at those of axis 1
    (``(batch, tokens, d)``). The hooks are removed on exit.

    Args:
        model: the model.
        vectors: site name -> vector ``(d,)``.
        scale: the factor of the vectors.
        positions: the positions (axis 1) to steer; ``None`` steers all.
        site: the module's ``"output"`` or ``"input"``.
        element: for tuple or mapping sites, the tensor (as in :func:`~attribution.patch`).

    Example:
        >>> from attribution import record
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        >>> x = torch.randn(1, 2)
        >>> with steer(model, {"0": torch.tensor([1.0, 0.0, -1.0])}, scale=2.0), record(model, "0") as acts:
        ...     _ = model(x)
        >>> bool(torch.allclose(acts["0"] - model[0](x), torch.tensor([[2.0, 0.0, -2.0]])))
        True
    """
    vectors = _vectors(vectors)

    def add(x: torch.Tensor, v: torch.Tensor, name: str) -> torch.Tensor:
        v = v * scale
        if positions is None:
            return x + v
        if x.dim() < 3:
            raise SiteValueError(f"`positions` index axis 1, but the site {name!r} has shape {tuple(x.shape)}")
        steered = x.clone()
        steered[:, list(positions)] += v
        return steered

    with _hooked(model, "steer", vectors, site, element, add):
        yield


@contextmanager
def ablate_direction(
    model: nn.Module, vectors: Mapping[str, torch.Tensor], *, site: Site = "output", element: Element = None
) -> Iterator[None]:
    """Project the unit direction ``vector / |vector|`` out of the sites' activations inside the ``with`` block.

    Each activation ``x`` (last axis) becomes ``x - (x . u) u``, ``u = vector / |vector|`` (directional ablation,
    Arditi et al. 2024), at every position.

    Args:
        model: the model.
        vectors: site name -> direction ``(d,)`` (any non-zero length).
        site: the module's ``"output"`` or ``"input"``.
        element: for tuple or mapping sites, the tensor.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> with ablate_direction(model, {"": torch.tensor([0.0, 3.0])}):
        ...     out = model(torch.randn(4, 2))
        >>> bool((out[:, 1] == 0).all())
        True
    """
    vectors = _vectors(vectors)
    for name, v in vectors.items():
        if not bool(v.norm() > 0):
            raise ValueError(f"`vectors`[{name!r}] is zero: a direction to ablate must have a length")

    with _hooked(model, "ablate_direction", vectors, site, element, lambda x, v, name: _math.project_out(x, v)):
        yield


def diff_means(
    model: nn.Module,
    data_a: Iterable[Any],
    data_b: Iterable[Any],
    layer: str,
    *,
    position: int | None = -1,
    site: Site = "output",
    element: Element = None,
) -> torch.Tensor:
    """The difference of the mean activations of ``layer`` over two prompt sets: ``mean_a - mean_b``, ``(d,)``.

    Args:
        model: the model (run in eval mode, without autograd; left as found).
        data_a: the first set: an iterable of model inputs (batches: token ids ``(batch, tokens)``, dicts, ...).
        data_b: the second set, the same way.
        layer: the module whose site is read.
        position: the position (axis 1) whose activations are averaged (default the last); ``None``: every position.
        site: the module's ``"output"`` or ``"input"``.
        element: for tuple or mapping sites, the tensor.

    Returns:
        A float64 CPU vector: the mean over set A's activations minus the mean over set B's.

    Example:
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.eye(2))
        >>> a, b = [torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]])], [torch.tensor([[[0.0, 1.0]]])]
        >>> diff_means(model, a, b, "")
        tensor([ 2., -1.], dtype=torch.float64)
    """
    means = [_mean(model, data, layer, position, site, element, what) for data, what in ((data_a, "a"), (data_b, "b"))]
    return means[0] - means[1]


def _mean(
    model: nn.Module, data: Iterable[Any], layer: str, position: int | None, site: Site, element: Element, what: str
) -> torch.Tensor:
    """The mean activation of ``layer`` over every batch of ``data`` (at ``position``), float64 on the CPU."""
    total: torch.Tensor | None = None
    count = 0

    def keep(x: torch.Tensor, name: str, call: int) -> None:
        nonlocal total, count
        rows = (x[:, position] if position is not None else x).detach().double().cpu().reshape(-1, x.shape[-1])
        total = rows.sum(0) if total is None else total + rows.sum(0)
        count += rows.shape[0]

    with HookedRun(eager_module(model), "diff_means") as run:
        hook_site(run.group, layer, site, element, keep)
        for batch in data:
            run.forward(batch)
    if total is None or count == 0:
        raise ValueError(f"`data_{what}` gave no activations of {layer!r}: give at least one batch")
    return total / count


def _vectors(vectors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(vectors, Mapping) or not vectors:
        raise TypeError("`vectors` must be a non-empty mapping {site name: vector (d,)}")
    out = {}
    for name, v in vectors.items():
        if not isinstance(v, torch.Tensor) or v.dim() != 1:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"`vectors`[{name!r}] must be a 1-d tensor (d,); got {shape}")
        out[name] = v.detach()
    return out


def _fitting(v: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    if v.shape[0] != x.shape[-1]:
        raise SiteValueError(
            f"the vector for {name!r} has {v.shape[0]} entries, but the site's activations have width {x.shape[-1]} "
            f"(shape {tuple(x.shape)})"
        )
    return v.to(device=x.device, dtype=x.dtype)


@contextmanager
def _hooked(
    model: nn.Module, group: str, vectors: dict[str, torch.Tensor], site: Site, element: Element, fn: Any
) -> Iterator[None]:
    """Call ``fn(x, vector, name)`` at each site of ``vectors`` (names, globs or modules), its result the new value."""
    if site not in ("output", "input"):
        raise ValueError(f"`site` must be 'output' or 'input'; got {site!r}")
    model = eager_module(model)
    by_name = {name: v for key, v in vectors.items() for name, _ in resolve(model, key, what="`vectors` key")}

    def hook(x: torch.Tensor, name: str, call: int) -> torch.Tensor:
        return fn(x, _fitting(by_name[name], x, name), name)

    with eager_if_compiled(model), HookManager(model) as mgr:
        hook_site(mgr.group(group), list(by_name), site, element, hook)
        yield
