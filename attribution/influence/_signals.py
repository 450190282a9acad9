"""One hooked forward and backward that hands each chosen module call's input and output gradient to a callback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hooks import HookManager

from .._run import kept_state
from ._batches import Loss, forward, labels_of, per_example_losses

OnSignal = Callable[[nn.Module, Tensor, Tensor], None]


def hooked_signals(model: nn.Module, batch: Any, loss: Loss, chosen: list[tuple[str, nn.Module]], on: OnSignal) -> None:
    """Run ``batch``; for every call of a chosen module, ``on(module, input, output gradient)`` after the run.

    The gradient is that of the summed per-example losses, taken by ``torch.autograd.grad`` (no ``.grad`` written);
    the model is left as found.
    """
    size = labels_of(batch).shape[0]
    seen: list[tuple[nn.Module, Tensor, Tensor]] = []
    params = [p for _, m in chosen for p in m.parameters(recurse=False) if p.requires_grad]

    def take(module: nn.Module, grad_input: Any, grad_output: Any, *, name: str, args: Any, kwargs: Any) -> None:
        if grad_output[0] is not None:
            seen.append((module, (args[0] if args else next(iter(kwargs.values()))).detach(), grad_output[0].detach()))

    with kept_state(model), HookManager(model) as manager, torch.enable_grad():
        manager.group("influence-signals").backward([m for _, m in chosen], take)
        losses = per_example_losses(loss, forward(model, batch), batch, size)
        torch.autograd.grad(losses.sum(), params, allow_unused=True)
    for module, a, delta in seen:
        on(module, a, delta)
