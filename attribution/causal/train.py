"""Train an intervention's parameters (the model frozen) and measure interchange intervention accuracy (IIA)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._progress import progress as progress_bar
from .._run import eager_module, kept_state
from ._data import Batches, prepare
from .interchange import check_source_shapes, intervening
from .interventions import BoundlessSubspace
from .site import Resolved, Site, resolve_site

Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def train_intervention(
    model: nn.Module,
    base: Any,
    sources: Any,
    labels: torch.Tensor,
    intervention: nn.Module,
    site: Site,
    *,
    loss: Loss | None = None,
    epochs: int = 1,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
    checkpoint: str | Path | None = None,
    progress: bool = True,
) -> nn.Module:
    """Train ``intervention`` at ``site`` so that the intervened model outputs ``labels`` (DAS, Geiger et al. 2023).

    Only the intervention's parameters train (Adam); the model's parameters get no gradient and the model is left
    as found. The sources' site activations are recorded once and reused across epochs. On a causal language model
    whose ``base`` is a tensor of token ids and whose site names its positions, the base's prefix before the first
    intervened position runs once and its keys/values are reused: each step runs only the suffix (a custom ``loss``
    then receives the suffix's output; its last position is the prompt's). A
    :class:`BoundlessSubspace`'s temperature is annealed linearly from its starting value to 0.1, as pyvene does.

    Args:
        model: the model.
        base: base inputs, a tensor ``(n, ...)`` or a dict of them.
        sources: source inputs shaped like ``base``.
        labels: ``(n,)`` counterfactual labels (what the high-level causal model predicts).
        intervention: the module to train (e.g. :class:`RotatedSubspace`).
        site: where it acts.
        loss: ``loss(output, labels) -> scalar``; default: cross-entropy of the last position's logits for
            ``(batch, T, vocab)`` outputs (or ``.logits``), of the output itself for ``(batch, classes)``.
        epochs: passes over the data.
        lr: Adam's learning rate.
        batch_size: items per step.
        seed: the shuffling's seed (epoch ``e`` uses ``seed + e``).
        checkpoint: a file written after every epoch; a new call with the same arguments resumes from it.
        progress: a progress bar over the epochs (shown on a terminal after a second).

    Returns:
        ``intervention``, trained.

    Raises:
        FloatingPointError: a loss that is not finite, naming the epoch, the step and the batch's rows.
    """
    model = eager_module(model)
    check_labels(base, labels)
    r = resolve_site(model, site)
    check_source_shapes(model, base, sources, [r.site])
    with kept_state(model):
        freeze(model)
        seen, data = prepare(model, base, sources, labels, [r], batch_size)[r]
        fit(model, seen, intervention, data, Schedule(epochs, lr, batch_size, seed), loss, checkpoint, progress)
    return intervention


def freeze(model: nn.Module) -> None:
    """No gradient for the model's parameters (inside ``kept_state``, which restores their flags)."""
    for p in model.parameters():
        p.requires_grad_(False)


@dataclass(frozen=True)
class Schedule:
    """How long and how fast an intervention trains."""

    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 64
    seed: int = 0


def fit(
    model: nn.Module,
    r: Resolved,
    intervention: nn.Module,
    data: Batches,
    schedule: Schedule,
    loss: Loss | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = False,
) -> None:
    """Adam on the intervention's parameters over ``data`` (the model frozen by the caller), resumable."""
    optimizer = torch.optim.Adam([p for p in intervention.parameters() if p.requires_grad], lr=schedule.lr)
    path = Path(checkpoint) if checkpoint is not None else None
    start, start_temperature = resume(path, intervention, optimizer)
    n, size = len(data.labels), schedule.batch_size
    steps = -(-n // size)
    temperatures = torch.linspace(start_temperature, 0.1, max(schedule.epochs * steps, 1))
    for epoch in progress_bar(range(start, schedule.epochs), desc="training the intervention", enabled=progress):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(schedule.seed + epoch))
        for step in range(steps):
            rows = order[step * size : (step + 1) * size]
            if isinstance(intervention, BoundlessSubspace):
                intervention.temperature.fill_(float(temperatures[epoch * steps + step]))
            train_step(model, r, intervention, optimizer, data, rows, loss, (epoch, step))
        if path is not None:
            save(path, intervention, optimizer, epoch + 1, start_temperature)


def train_step(
    model: nn.Module,
    r: Resolved,
    intervention: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Batches,
    rows: torch.Tensor,
    loss: Loss | None,
    where: tuple[int, int],
) -> None:
    """One optimiser step on ``rows``; a loss that is not finite stops training, naming the epoch, step and rows."""
    with torch.enable_grad():
        value = step_loss(model, r, intervention, rows, data, loss)
    check_finite(value, where, rows)
    optimizer.zero_grad()
    value.backward()
    optimizer.step()


def check_finite(value: torch.Tensor, where: tuple[int, int], rows: torch.Tensor) -> None:
    """Raise a ``FloatingPointError`` naming the epoch, step and batch rows unless ``value`` is finite."""
    if not torch.isfinite(value):
        epoch, step = where
        raise FloatingPointError(
            f"the loss is {value.item()} at epoch {epoch}, step {step} (batch rows {rows[:8].tolist()}"
            f"{'...' if len(rows) > 8 else ''}): lower `lr`, or check the labels and the loss"
        )


def check_labels(base: Any, labels: torch.Tensor) -> int:
    """The number of items, after checking ``labels`` has one per base row."""
    n = len(next(iter(base.values())) if isinstance(base, Mapping) else base)
    if not isinstance(labels, torch.Tensor) or labels.shape != (n,):
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"`labels` must be a tensor of shape ({n},), one per base item; got {got}")
    return n


def logits_of(output: Any) -> torch.Tensor:
    """The classes' scores: ``.logits`` or the output, at the last position for ``(batch, T, vocab)``."""
    logits = getattr(output, "logits", output)
    return logits[:, -1] if logits.dim() == 3 else logits


def step_loss(
    model: nn.Module, r: Resolved, intervention: nn.Module, rows: torch.Tensor, data: Batches, loss: Loss | None
) -> torch.Tensor:
    """One batch's loss with the intervention applied (on the cached prefix where there is one)."""
    with intervening(model, [r], {r.site: data.source_acts[rows]}, {r.site: intervention}):
        output = data.run(model, rows)
    if loss is not None:
        return loss(output, data.labels[rows])
    return nn.functional.cross_entropy(logits_of(output), data.labels[rows])


def resume(path: Path | None, intervention: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, float]:
    """The epoch to start at and the starting temperature, loading ``path`` where it exists."""
    temperature = getattr(intervention, "temperature", None)
    start_temperature = float(temperature) if temperature is not None else 1.0
    if path is None or not path.exists():
        return 0, start_temperature
    state = torch.load(path, weights_only=True)
    intervention.load_state_dict(state["intervention"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]), float(state["start_temperature"])


def save(path: Path, intervention: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, temperature: float) -> None:
    """Write the checkpoint atomically (a temporary file, then a rename)."""
    state = {
        "intervention": intervention.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "start_temperature": temperature,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def interchange_intervention_accuracy(
    model: nn.Module, base: Any, sources: Any, labels: torch.Tensor, intervention: nn.Module, site: Site
) -> float:
    """IIA: the fraction of items whose intervened output's argmax (last position for sequences) is the label.

    Args:
        model: the model.
        base: base inputs, a tensor ``(n, ...)`` or a dict of them.
        sources: source inputs shaped like ``base``.
        labels: ``(n,)`` counterfactual labels.
        intervention: the (trained) intervention.
        site: where it acts.

    Returns:
        The accuracy in ``[0, 1]``.
    """
    model = eager_module(model)
    check_labels(base, labels)
    r = resolve_site(model, site)
    check_source_shapes(model, base, sources, [r.site])
    with kept_state(model), torch.no_grad():
        seen, data = prepare(model, base, sources, labels, [r], SCORING_BATCH)[r]
        return accuracy(model, seen, intervention, data)


SCORING_BATCH = 256


def accuracy(model: nn.Module, r: Resolved, intervention: nn.Module, data: Batches) -> float:
    """The fraction of ``data``'s rows whose intervened output's argmax is the label (batches of 256, no autograd)."""
    n = len(data.labels)
    right = 0
    with torch.no_grad():
        for rows in torch.arange(n).split(SCORING_BATCH):
            with intervening(model, [r], {r.site: data.source_acts[rows]}, {r.site: intervention}):
                predicted = logits_of(data.run(model, rows)).argmax(-1)
            right += int((predicted == data.labels[rows]).sum())
    return right / n
