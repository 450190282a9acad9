"""What the reference-based methods take, checked: the model, the inputs, and one baseline per item or a set."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._inputs import refuse_integer_images
from .._run import eager_module

Baseline = float | int | torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
"""A ``baseline=``/``baselines=``: a number, a tensor, or a callable ``inputs -> tensor``."""


def check_model(model: object) -> nn.Module:
    """The module the methods hook: ``model`` itself, or the module behind ``torch.compile(model)`` (run eagerly)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
    return eager_module(model)


def check_inputs(inputs: object, method: str) -> torch.Tensor:
    """``inputs`` as the methods take them: a floating-point tensor ``(batch, ...)``; integer images are refused."""
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"{method} takes `inputs` as one tensor (batch, ...); got {type(inputs).__name__}")
    refuse_integer_images(inputs, False)  # uint8 images: the same conversion hint as the CAMs
    if not inputs.is_floating_point():
        raise TypeError(
            f"`inputs` are {inputs.dtype}: {method} needs floating-point inputs (batch, ...). Convert them with "
            "`inputs.float()`, or for token ids attribute at the embedding layer with a gradient method"
        )
    if inputs.dim() < 2:
        raise ValueError(f"`inputs` must be (batch, ...) with a batch axis; got shape {tuple(inputs.shape)}")
    return inputs


def baseline_like(given: Baseline, x: torch.Tensor, what: str = "`baseline`") -> torch.Tensor:
    """One baseline per item, shaped like ``x``: from a number, a tensor like ``x``, one item or ``(1, ...)``.

    Example:
        >>> baseline_like(0.5, torch.zeros(2, 3)).shape
        torch.Size([2, 3])
    """
    base = _tensor(given, x, what)
    if tuple(base.shape) not in (tuple(x.shape), tuple(x.shape[1:]), (1, *x.shape[1:])):
        raise ValueError(
            f"{what} has shape {tuple(base.shape)}, but `inputs` are {tuple(x.shape)}: give a baseline shaped like "
            f"`inputs` {tuple(x.shape)}, like one item {tuple(x.shape[1:])} or (1, ...), or a number"
        )
    return _finite(base, what).expand_as(x)


def reference_set(given: Baseline, x: torch.Tensor, what: str = "`baselines`") -> torch.Tensor:
    """A set of ``n`` baselines ``(n, *item)``: from a number, one item ``item`` or ``(n, *item)`` tensors.

    Example:
        >>> reference_set(torch.zeros(4, 3), torch.ones(2, 3)).shape, reference_set(0.0, torch.ones(2, 3)).shape
        (torch.Size([4, 3]), torch.Size([1, 3]))
    """
    base = _tensor(given, x, what)
    item = tuple(x.shape[1:])
    if tuple(base.shape) == item:
        base = base[None]
    elif tuple(base.shape[1:]) != item or base.shape[0] == 0:
        raise ValueError(
            f"{what} has shape {tuple(base.shape)}, but the items of `inputs` {tuple(x.shape)} are {item}: give "
            f"baselines (n, {', '.join(map(str, item))}) (n >= 1 references, each shaped like one item), one item "
            f"{item}, or a number"
        )
    return _finite(base, what)


def _tensor(given: Baseline, x: torch.Tensor, what: str) -> torch.Tensor:
    """``given`` as a tensor of ``x``'s dtype and device (numbers filled, callables called on ``x``)."""
    if isinstance(given, bool):
        raise TypeError(f"{what} must be a number, a tensor or a callable inputs -> tensor; got a bool")
    if isinstance(given, (int, float)):
        return torch.full(x.shape[1:], float(given), dtype=x.dtype, device=x.device)
    base = given(x) if callable(given) and not isinstance(given, torch.Tensor) else given
    source = f"the tensor that {what} returned" if base is not given else what
    if not isinstance(base, torch.Tensor):
        raise TypeError(f"{source} must be a number or a tensor; got {type(base).__name__}")
    if not base.is_floating_point():
        raise TypeError(f"{source} is {base.dtype} but `inputs` are {x.dtype}: give floating-point baselines")
    return base.detach().to(device=x.device, dtype=x.dtype)


def _finite(base: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(base).all()):
        raise ValueError(f"{what} holds NaN or inf: every reference must be finite (check how it was built)")
    return base
