"""Batches and per-example losses: what a batch is, how the model and the loss are called, a loader or one batch.

A batch is ``(inputs, labels)`` (a tuple or a list, as a ``DataLoader`` of a ``TensorDataset`` yields it) or a
mapping whose ``labels`` key holds the labels and whose other keys are the model's keyword inputs. A loss is a
callable ``(outputs, batch) -> (batch,)`` or an ``nn.Module`` with ``reduction="none"`` called as
``loss(outputs, labels)``; a ``(batch, 1)`` result counts as one loss per example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._inputs import call

Loss = Callable[[Any, Any], Tensor] | nn.Module


def is_batch(data: Any) -> bool:
    """Whether ``data`` is one batch (a mapping, or a pair whose labels are a tensor) rather than many."""
    if isinstance(data, Mapping):
        return True
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], Tensor)


def batches(data: Any) -> Iterator[Any]:
    """The batches of ``data``: itself when it is one batch, else what iterating it gives (a DataLoader)."""
    if is_batch(data):
        yield data
        return
    if not isinstance(data, Iterable) or isinstance(data, (Tensor, str)):
        raise TypeError(
            f"expected a batch `(inputs, labels)`, a dict with a 'labels' key, or a DataLoader of batches; got "
            f"{type(data).__name__}. Wrap tensors as (inputs, labels)"
        )
    for batch in data:
        if not is_batch(batch):
            raise TypeError(
                f"each batch must be `(inputs, labels)` with tensor labels or a dict with a 'labels' key; got "
                f"{type(batch).__name__}"
            )
        yield batch


def labels_of(batch: Any) -> Tensor:
    """The labels of a batch (``batch[1]``, or ``batch["labels"]``)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise KeyError(
                f"a dict batch needs a 'labels' key (the other keys are the model's inputs); got keys {list(batch)}"
            )
        return batch["labels"]
    return batch[1]


def forward(model: nn.Module, batch: Any) -> Any:
    """The model's outputs: ``model(**inputs)`` for a mapping, else as ``attribution`` calls inputs everywhere."""
    if isinstance(batch, Mapping):
        return model(**{key: value for key, value in batch.items() if key != "labels"})
    return call(model, batch[0])


def check_loss(loss: Any) -> None:
    """Refuse a loss module that reduces over the batch before anything runs."""
    if isinstance(loss, nn.Module) and getattr(loss, "reduction", "none") != "none":
        raise ValueError(
            f"`loss` {type(loss).__name__} has reduction={loss.reduction!r}: per-example gradients need one loss per "
            f"example (a mean or sum mixes the examples' gradients into one). Pass {type(loss).__name__}"
            "(reduction='none')"
        )
    if not callable(loss):
        raise TypeError(f"`loss` must be a callable (outputs, batch) -> (batch,) or an nn.Module; got {loss!r}")


def per_example_losses(loss: Loss, outputs: Any, batch: Any, size: int) -> Tensor:
    """The ``(batch,)`` losses, checked: one per example, all finite."""
    if isinstance(loss, nn.Module):
        if not isinstance(outputs, Tensor):
            raise TypeError(
                f"the loss module {type(loss).__name__} is called as loss(outputs, labels), but the model returned "
                f"{type(outputs).__name__}; pass a callable such as `lambda out, batch: loss(out.logits, "
                "batch['labels'])`"
            )
        losses = loss(outputs, labels_of(batch))
    else:
        losses = loss(outputs, batch)
    if not isinstance(losses, Tensor) or losses.ndim == 0:
        raise ValueError(
            "`loss` returned one number for the whole batch (mean- or sum-reduced): per-example gradients need one "
            f"loss per example, shape ({size},). Use reduction='none' (and sum over positions yourself if needed)"
        )
    if losses.ndim == 2 and losses.shape[1] == 1:
        losses = losses[:, 0]
    if losses.shape != (size,):
        raise ValueError(
            f"`loss` must return one loss per example, shape ({size},) (the batch size of the labels); got "
            f"{tuple(losses.shape)}. Reduce every other axis (positions, classes) inside the loss"
        )
    bad = (~torch.isfinite(losses.detach())).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"the loss is not finite for examples {bad.tolist()[:10]} of the batch (values "
            f"{losses.detach()[bad[:3]].tolist()}): their gradients are meaningless; fix or drop those examples"
        )
    return losses
