"""The autograd function that carries a DeepLIFT rule on a product; a module's plain vector-Jacobian product.

A rule on one module's output is carried by the kernel's ``Replace`` (``attribution/_transformer_rules.py``), the
same autograd function as AttnLRP's rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Step = Callable[[torch.Tensor], torch.Tensor]
"""A rule's backward: the gradient at the module's output -> the modified gradient at its input."""


class Product(torch.autograd.Function):
    """``(a, b) -> box[0]`` (their product, as the model computed it) whose backward is ``box[1](grad)``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, box: list[Any]) -> torch.Tensor:
        """Return ``box[0]``; keep the step ``box[1]``, which returns the gradients of ``a`` and ``b``."""
        ctx.step = box[1]
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The rule's step."""
        grad_a, grad_b = ctx.step(grad)
        return grad_a, grad_b, None


def module_vjp(module: torch.nn.Module, x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The ordinary gradient ``seed^T d module(x) / dx``, by autograd through ``module.forward`` (no hooks fire)."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_(True)
        out = module.forward(leaf.clone())  # a copy: an in-place module must not write into the leaf
        (grad,) = torch.autograd.grad(out, leaf, seed)
    return grad
