"""``causal_check``: what the model does when the probe's direction is taken out of its activations, or pushed along."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookGroup, resolve

from .._inputs import batch_size as items_in
from .._run import HookedRun, eager_module, hook_site
from ._record import batches
from .probe import ProbeResult

Metric = Callable[[Any], torch.Tensor]


def causal_check(
    model: nn.Module,
    result: ProbeResult,
    site: str,
    data: Any,
    metric: Metric,
    how: Literal["ablate", "steer"] = "ablate",
    *,
    scale: float | None = None,
    batch_size: int = 64,
    clean: float | None = None,
) -> float:
    """The change of ``metric`` when the probe's direction is intervened on at ``site``: intervened minus clean.

    At the rows the probe read (its ``position``, or every token), ``how="ablate"`` projects the direction out of
    the activation (``x - (x . u) u``; for more than two classes the span of all the class directions), and
    ``how="steer"`` adds ``scale * u`` (default ``result.gap[site]``: the step from class 0's mean to class 1's, two
    classes only). A probe whose accuracy is high while this change is nil has found information the model does not
    use there.

    Args:
        model: the model the probe was fitted on.
        result: what :func:`probe` returned.
        site: one of its sites (a module name).
        data: inputs as :func:`probe` takes them.
        metric: ``model outputs -> tensor``: one value per item ``(batch,)`` or one per batch (a scalar); averaged
            over the items.
        how: ``"ablate"`` or ``"steer"``.
        scale: the steering step along the unit direction.
        batch_size: items per forward when ``data`` is a tensor or mapping.
        clean: ``mean metric(clean)`` on ``data`` if already measured (a sweep over sites needs it once); by default
            it is measured here.

    Returns:
        ``mean metric(intervened) - mean metric(clean)``.

    Example:
        >>> from attribution.probes import probe
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(100, 3)
        >>> model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(3, 1))
        >>> result = probe(model, x, (x[:, 0] > 0).long(), "0")
        >>> change = causal_check(model, result, "0", x, lambda out: out[:, 0], how="steer", scale=1.0)
        >>> expected = model[1].weight[0].detach().double() @ result.direction["0"]  # the head along the direction
        >>> abs(change - float(expected)) < 1e-6
        True
    """
    if site not in result.direction:
        raise KeyError(f"`site` {site!r} is not one of the probe's sites {list(result.direction)}")
    if how not in ("ablate", "steer"):
        raise ValueError(f"`how` must be 'ablate' or 'steer'; got {how!r}")
    direction = result.direction[site]
    if how == "steer" and direction.dim() != 1:
        raise ValueError(
            f"steering needs one direction; this probe has {result.classes} classes: steer one row of "
            "result.direction[site] with attribution.steer"
        )
    step = (result.gap[site] if scale is None else scale) if how == "steer" else 0.0
    basis = torch.linalg.qr(direction.reshape(-1, direction.shape[-1]).T).Q  # (d, rank): the directions' span
    [(name, _)] = resolve(eager_module(model), site, what="`site`")

    def change(x: torch.Tensor) -> torch.Tensor:
        if how == "steer":
            return x + step * direction.to(device=x.device, dtype=x.dtype)
        b = basis.to(device=x.device, dtype=x.dtype)
        return x - (x @ b) @ b.T

    def edit(group: HookGroup) -> None:
        hook_site(group, name, result.site, result.element, lambda x, _n, _c: _at(x, result.position, change))

    if clean is None:
        clean = _mean_metric(model, data, metric, batch_size)
    return _mean_metric(model, data, metric, batch_size, edit) - clean


def _mean_metric(
    model: nn.Module, data: Any, metric: Metric, batch_size: int, edit: Callable[[HookGroup], None] | None = None
) -> float:
    """The mean of ``metric`` over ``data``'s items, with ``edit`` registering the intervention's hook, or without."""
    total, count = 0.0, 0
    with HookedRun(eager_module(model), "causal_check") as run:
        if edit is not None:
            edit(run.group)
        for batch in batches(data, batch_size):
            values = torch.as_tensor(metric(run.forward(batch))).detach().double()
            n = items_in(batch) if values.dim() == 0 else values.numel()
            total += float(values.sum()) * (n if values.dim() == 0 else 1)
            count += n
    if count == 0:
        raise ValueError("`data` gave no batches: give at least one")
    return total / count


def _at(x: torch.Tensor, position: int | None, change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``change`` applied to the rows the probe read: all of ``(batch, d)``, or position ``position`` of axis 1."""
    if x.dim() == 2 or position is None:
        return change(x)
    out = x.clone()
    out[:, position] = change(x[:, position])
    return out
