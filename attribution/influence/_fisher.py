"""The labels the Fisher is taken at: the model's own samples for the losses it knows, or the true labels.

``fisher="sampled"`` (the true Fisher, as Grosse et al. 2023 and Kronfluence use it) draws each example's label from
the model's predictive distribution: categorical for ``nn.CrossEntropyLoss`` (logits ``(batch, classes)``), and for
``nn.MSELoss`` a Gaussian around the output with variance 1/2, for which ``E[delta delta^T] = 2 I`` equals the squared
error's own second derivative (the sampled Fisher is then the Gauss-Newton matrix, the Hessian of a linear model).
``fisher="empirical"`` keeps the true labels; any other loss needs it or a ``sample_labels(outputs, batch, generator)``
callable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

SampleLabels = Callable[[Any, Any, torch.Generator], Tensor]


def check_fisher(fisher: str, loss: Any, sample_labels: SampleLabels | None) -> None:
    """Refuse a Fisher that cannot be taken with this loss."""
    if fisher not in ("sampled", "empirical"):
        raise ValueError(f"`fisher` must be 'sampled' or 'empirical'; got {fisher!r}")
    known = isinstance(loss, (nn.CrossEntropyLoss, nn.MSELoss))
    if fisher == "sampled" and sample_labels is None and not known:
        raise ValueError(
            f"fisher='sampled' draws labels from the model's distribution, which is known for nn.CrossEntropyLoss and "
            f"nn.MSELoss, not for {type(loss).__name__}: pass fisher='empirical' (the true labels) or "
            "sample_labels=lambda outputs, batch, generator: labels"
        )


def sampled(outputs: Tensor, loss: nn.Module, generator: torch.Generator) -> Tensor:
    """Labels drawn from the model's predictive distribution for a cross-entropy or squared-error loss."""
    detached = outputs.detach()
    if isinstance(loss, nn.CrossEntropyLoss):
        probabilities = torch.softmax(detached.double(), dim=-1).cpu()
        return torch.multinomial(probabilities, 1, generator=generator)[:, 0].to(detached.device)
    noise = torch.randn(detached.shape, generator=generator, dtype=detached.dtype).to(detached.device)
    return detached + noise * 0.5**0.5


def with_labels(batch: Any, labels: Tensor) -> Any:
    """``batch`` with its labels replaced."""
    if isinstance(batch, Mapping):
        return {**batch, "labels": labels}
    return (batch[0], labels)


def fisher_batch(
    batch: Any,
    outputs: Any,
    loss: Any,
    fisher: str,
    sample_labels: SampleLabels | None,
    generator: torch.Generator,
) -> Any:
    """The batch whose labels the Fisher's gradients use: the true ones, or ones drawn given the outputs."""
    if fisher == "empirical":
        return batch
    if sample_labels is not None:
        return with_labels(batch, sample_labels(outputs, batch, generator))
    return with_labels(batch, sampled(outputs, loss, generator))
