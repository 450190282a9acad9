"""``probe``: a classifier per site on recorded activations, with its control task and its direction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._run import Element
from . import _fit
from ._control import control_labels
from ._record import record_rows


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` found, per site (a module name).

    Attributes:
        accuracy: held-out accuracy of the probe.
        control_accuracy: held-out accuracy of the same kind of probe on the control task (``nan`` without it).
        selectivity: ``accuracy - control_accuracy`` (Hewitt & Liang).
        direction: the linear probe's unit direction: ``(d,)`` for two classes (towards class 1), ``(classes, d)``
            otherwise (each class against the average); usable with :func:`~attribution.steer` and
            :func:`~attribution.ablate_direction`. For ``kind="mlp"`` it comes from a linear probe fitted beside.
        gap: for two classes, the distance along ``direction`` between the training rows' class means (class 1's
            minus class 0's): the default step of ``causal_check(how="steer")``; ``nan`` for more classes.
        position, site, element: where the activations were read (as passed to :func:`probe`).
        kind: ``"linear"`` or ``"mlp"``.
        classes: the number of classes.
    """

    accuracy: dict[str, float]
    control_accuracy: dict[str, float]
    selectivity: dict[str, float]
    direction: dict[str, torch.Tensor]
    gap: dict[str, float]
    position: int | None
    site: Literal["output", "input"]
    element: Element
    kind: str
    classes: int


def probe(
    model: nn.Module,
    data: Any,
    labels: torch.Tensor,
    sites: Any,
    kind: Literal["linear", "mlp"] = "linear",
    control: bool = True,
    seed: int = 0,
    *,
    position: int | None = -1,
    site: Literal["output", "input"] = "output",
    element: Element = None,
    held_out: float = 0.25,
    batch_size: int = 64,
    control_keys: torch.Tensor | None = None,
) -> ProbeResult:
    """Train a probe per site on the model's activations and score it on held-out items, beside its control task.

    The activations of each site are recorded over ``data`` (one run, no autograd, the model left as found): one row
    per item at ``position`` of ``(batch, tokens, d)`` activations (``None``: one row per token, ``labels`` then
    ``(items, tokens)``), or per item for ``(batch, d)``. A random ``held_out`` share of rows (seeded) is kept aside.
    ``kind="linear"`` is multinomial logistic regression (L2 1e-3 on standardised activations, L-BFGS, float64);
    ``"mlp"`` one ReLU hidden layer of 128 units (Adam, 300 full-batch steps). The control task (Hewitt & Liang
    2019) gives every type one fixed random label drawn from the label frequencies: the type of a row is its token id
    when ``data`` holds token ids (the word at the probed position), else the row itself (then the control task is
    memorising random labels, and its held-out accuracy is chance), or ``control_keys`` ``(rows,)``.

    Args:
        model: the model.
        data: a tensor of inputs ``(items, ...)`` (run in batches of ``batch_size``), a mapping of such tensors
            (HF keyword inputs), or an iterable of batches.
        labels: integer labels ``(items,)`` (``(items, tokens)`` with ``position=None``), classes 0 to C - 1.
        sites: module names, globs or modules whose activations are probed.
        kind: ``"linear"`` or ``"mlp"``.
        control: also fit the control task.
        seed: seeds the split, the control labels and the MLP.
        position: the position (axis 1) of sequence activations read; ``None`` reads every token.
        site: the module's ``"output"`` or ``"input"``.
        element: for tuple or mapping sites, the tensor.
        held_out: the share of rows kept for scoring.
        batch_size: items per forward when ``data`` is a tensor or mapping.
        control_keys: the type of each row for the control task.

    Returns:
        A :class:`ProbeResult`.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(200, 4)
        >>> y = (x[:, 1] > 0).long()                       # the label is the sign of feature 1
        >>> result = probe(torch.nn.Sequential(torch.nn.Identity()), x, y, "0")
        >>> result.accuracy["0"] > 0.95, result.selectivity["0"] > 0.3
        (True, True)
        >>> result.direction["0"].abs().argmax().item()
        1
    """
    if kind not in ("linear", "mlp"):
        raise ValueError(f"`kind` must be 'linear' or 'mlp'; got {kind!r}")
    if not 0 < held_out < 1:
        raise ValueError(f"`held_out` must be a share between 0 and 1; got {held_out}")
    acts, keys = record_rows(model, data, sites, position=position, site=site, element=element, batch_size=batch_size)
    y = _labels(labels, len(keys))
    keys = keys if control_keys is None else _keys(control_keys, len(keys))
    classes = int(y.max()) + 1
    train, test = _split(len(y), held_out, seed)
    fake = control_labels(keys, y[train], classes, seed) if control else None
    found: dict[str, dict[str, Any]] = {}
    for name, x in acts.items():
        found[name] = _one_site(x, y, fake, train, test, kind, classes, seed)
    return ProbeResult(
        **{field: {name: site_found[field] for name, site_found in found.items()} for field in _FIELDS},
        position=position,
        site=site,
        element=element,
        kind=kind,
        classes=classes,
    )


_FIELDS = ("accuracy", "control_accuracy", "selectivity", "direction", "gap")


def _one_site(
    x: torch.Tensor,
    y: torch.Tensor,
    fake: torch.Tensor | None,
    train: torch.Tensor,
    test: torch.Tensor,
    kind: str,
    classes: int,
    seed: int,
) -> dict[str, Any]:
    """Fit the probe (and the control) on the training rows of one site; score both on the held-out rows."""

    def fit(labels: torch.Tensor) -> _fit.Predict:
        if kind == "linear":
            return _fit.fit_linear(x[train], labels[train], classes)
        return _fit.fit_mlp(x[train], labels[train], classes, seed=seed)

    linear = _fit.fit_linear(x[train], y[train], classes)
    accuracy = _fit.accuracy(linear if kind == "linear" else fit(y), x[test], y[test])
    control = float("nan") if fake is None else _fit.accuracy(fit(fake), x[test], fake[test])
    direction = _fit.directions(linear)
    gap = float("nan")
    if classes == 2:
        along = x[train] @ direction
        gap = float(along[y[train] == 1].mean() - along[y[train] == 0].mean())
    return {
        "accuracy": accuracy,
        "control_accuracy": control,
        "selectivity": accuracy - control,
        "direction": direction,
        "gap": gap,
    }


def _labels(labels: Any, rows: int) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"`labels` must be an integer tensor of class indices; got {_what(labels)}")
    y = labels.reshape(-1).long().cpu()
    if len(y) != rows:
        raise ValueError(
            f"`labels` has {len(y)} entries (shape {tuple(labels.shape)}), but the data gave {rows} rows of "
            "activations: one label per item (per token with position=None)"
        )
    if bool((y < 0).any()):
        raise ValueError("`labels` must be class indices 0 to C - 1; found a negative label")
    if len(torch.unique(y)) < 2:
        raise ValueError(f"`labels` hold one class only ({int(y[0])}): a probe needs at least two")
    return y


def _keys(keys: Any, rows: int) -> torch.Tensor:
    if not isinstance(keys, torch.Tensor) or len(keys.reshape(-1)) != rows:
        raise ValueError(f"`control_keys` must be a tensor of {rows} type keys, one per row; got {_what(keys)}")
    return keys.reshape(-1).cpu()


def _split(n: int, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random split of ``n`` rows: ``round(held_out * n)`` (at least 1) held out, the rest (2 or more) kept."""
    test_size = max(1, round(held_out * n))
    if n - test_size < 2:
        raise ValueError(f"{n} rows are too few to hold out {held_out:.0%} and train on the rest: give more data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[test_size:], order[:test_size]


def _what(x: Any) -> str:
    return f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
