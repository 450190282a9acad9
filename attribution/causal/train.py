"""Train an intervention's parameters (the model frozen) and measure interchange intervention accuracy (IIA)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._run import eager_module, kept_state
from ..patching.sites import record
from ._prefix import Prefix, record_prefix, shifted
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

    Returns:
        ``intervention``, trained.

    Raises:
        FloatingPointError: a loss that is not finite, naming the epoch, the step and the batch's rows.
    """
    model = eager_module(model)
    n = check_labels(base, labels)
    r = resolve_site(model, site)
    check_source_shapes(model, base, sources, [r.site])
    optimizer = torch.optim.Adam([p for p in intervention.parameters() if p.requires_grad], lr=lr)
    path = Path(checkpoint) if checkpoint is not None else None
    start, start_temperature = resume(path, intervention, optimizer)
    steps = -(-n // batch_size)
    schedule = torch.linspace(start_temperature, 0.1, max(epochs * steps, 1))
    with kept_state(model):
        for p in model.parameters():
            p.requires_grad_(False)  # restored by kept_state: no gradient buffers for the model
        source_acts = site_activations(model, sources, r, batch_size)
        prefix = record_prefix(model, base, r, batch_size)
        if prefix is not None:  # every step runs only the suffix after the first intervened position
            r, source_acts = shifted(r, prefix.length, base.shape[1]), source_acts[:, prefix.length :]
        data = Batches(base, source_acts, labels, prefix)
        for epoch in range(start, epochs):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            for step in range(steps):
                rows = order[step * batch_size : (step + 1) * batch_size]
                if isinstance(intervention, BoundlessSubspace):
                    intervention.temperature.fill_(float(schedule[epoch * steps + step]))
                train_step(model, r, intervention, optimizer, data, rows, loss, (epoch, step))
            if path is not None:
                save(path, intervention, optimizer, epoch + 1, start_temperature)
    return intervention


@dataclass(frozen=True)
class Batches:
    """What every training step draws its rows from."""

    base: Any
    source_acts: torch.Tensor
    labels: torch.Tensor
    prefix: Prefix | None


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
        value = step_loss(model, r, intervention, rows, data.base, data.source_acts, data.labels, loss, data.prefix)
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


def rows_of(inputs: Any, rows: torch.Tensor | slice) -> Any:
    """The chosen rows of a tensor or of each tensor of a dict."""
    if isinstance(inputs, Mapping):
        return {k: v[rows] for k, v in inputs.items()}
    return inputs[rows]


def run(model: nn.Module, inputs: Any) -> Any:
    """The model on a tensor or on a dict of keyword inputs."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def site_activations(model: nn.Module, sources: Any, r: Resolved, batch_size: int) -> torch.Tensor:
    """The sources' whole activations at the site, recorded in batches without autograd."""
    n = len(next(iter(sources.values())) if isinstance(sources, Mapping) else sources)
    parts = []
    with record(model, r.name, site=r.site.site, element=r.site.element) as acts, torch.no_grad():
        for i in range(0, n, batch_size):
            run(model, rows_of(sources, slice(i, i + batch_size)))
            parts.append(acts[r.name])
    return torch.cat(parts)


def logits_of(output: Any) -> torch.Tensor:
    """The classes' scores: ``.logits`` or the output, at the last position for ``(batch, T, vocab)``."""
    logits = getattr(output, "logits", output)
    return logits[:, -1] if logits.dim() == 3 else logits


def step_loss(
    model: nn.Module,
    r: Resolved,
    intervention: nn.Module,
    rows: torch.Tensor,
    base: Any,
    source_acts: torch.Tensor,
    labels: torch.Tensor,
    loss: Loss | None,
    prefix: Prefix | None = None,
) -> torch.Tensor:
    """One batch's loss with the intervention applied (on the cached prefix where there is one)."""
    with intervening(model, [r], {r.site: source_acts[rows]}, {r.site: intervention}):
        output = run(model, rows_of(base, rows)) if prefix is None else prefix.run(model, base, rows)
    if loss is not None:
        return loss(output, labels[rows])
    return nn.functional.cross_entropy(logits_of(output), labels[rows])


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
    n = check_labels(base, labels)
    r = resolve_site(model, site)
    check_source_shapes(model, base, sources, [r.site])
    with kept_state(model), torch.no_grad():
        source_acts = site_activations(model, sources, r, 256)
        with intervening(model, [r], {r.site: source_acts}, {r.site: intervention}):
            predicted = logits_of(run(model, base)).argmax(-1)
    return float((predicted == labels).sum()) / n
