"""The Hessian of the mean training loss in chosen parameters, jointly: explicit, or its products with vectors.

The explicit Hessian is for small models; a product is a double backward, one pass over the training source.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


def hessian_vector_products(
    model: nn.Module, train: Any, loss: Loss, params: list[tuple[str, Tensor]]
) -> Callable[[Tensor], Tensor]:
    """``v -> H v`` with ``H`` the Hessian of :func:`exact_hessian`; each call makes one pass over ``train``."""
    flat = torch.cat([p.detach().flatten() for _, p in params])

    def product(vector: Tensor) -> Tensor:
        total, count = torch.zeros_like(flat), 0
        with kept_state(model), torch.enable_grad():
            for batch in batches(train):
                size = labels_of(batch).shape[0]
                point = flat.clone().requires_grad_(True)
                outputs = _functional_call(model, _split(point, params), batch)
                (gradient,) = torch.autograd.grad(
                    per_example_losses(loss, outputs, batch, size).sum(), point, create_graph=True
                )
                if gradient.requires_grad:  # else the loss is linear in the parameters: no curvature
                    total += torch.autograd.grad(gradient @ vector, point, materialize_grads=True)[0]
                count += size
        if count == 0:
            raise ValueError(
                "the training source gave no examples for a Hessian-vector product: method='arnoldi' passes over it "
                "once per step, so it must be iterable again (a DataLoader or a list of batches, not a generator)"
            )
        return total / count

    return product


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
