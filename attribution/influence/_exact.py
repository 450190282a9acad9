"""The explicit Hessian of the mean training loss with respect to chosen parameters, jointly (for small models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._run import kept_state
from ._batches import Loss, batches, labels_of, per_example_losses


def exact_hessian(model: nn.Module, train: Any, loss: Loss, params: list[tuple[str, Tensor]]) -> Tensor:
    """``(P, P)``: the Hessian of the mean per-example loss over ``train`` in the flattened ``params`` (in order)."""
    flat = torch.cat([p.detach().flatten() for _, p in params])
    total = flat.new_zeros(len(flat), len(flat))
    count = 0
    with kept_state(model):
        for batch in batches(train):
            size = labels_of(batch).shape[0]

            def summed(vector: Tensor, batch: Any = batch, size: int = size) -> Tensor:
                outputs = _functional_call(model, _split(vector, params), batch)
                return per_example_losses(loss, outputs, batch, size).sum()

            total += torch.func.hessian(summed)(flat)
            count += size
    return total / count


def _split(vector: Tensor, params: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """``vector`` cut into the parameters' shapes, by name."""
    out, start = {}, 0
    for name, p in params:
        out[name] = vector[start : start + p.numel()].view_as(p)
        start += p.numel()
    return out


def _functional_call(model: nn.Module, tensors: dict[str, Tensor], batch: Any) -> Any:
    """The model's outputs on ``batch`` with ``tensors`` in place of the named parameters."""
    if isinstance(batch, Mapping):
        kwargs = {key: value for key, value in batch.items() if key != "labels"}
        return torch.func.functional_call(model, tensors, (), kwargs, strict=False)
    inputs = batch[0]
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return torch.func.functional_call(model, tensors, args, strict=False)
