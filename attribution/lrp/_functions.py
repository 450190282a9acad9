"""The autograd functions that carry relevance backwards in place of a layer's gradient.

Each takes the layer's input as its differentiable argument and the layer's output (computed without autograd) in
a list, and returns that output: its backward is the rule's step only, so neither the layer's own backward nor its
weight gradients run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .rules import Step, stabilize


class RuleFunction(torch.autograd.Function):
    """``x -> output`` whose backward is a rule's step ``(R_out, x) -> R_in``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[torch.Tensor], step: Step) -> torch.Tensor:
        """Return ``box[0]`` (the layer's output, computed without autograd) and keep ``x`` and the step."""
        ctx.save_for_backward(x)
        ctx.step = step
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """The rule's step."""
        (x,) = ctx.saved_tensors
        return ctx.step(grad, x), None, None


class PassFunction(torch.autograd.Function):
    """``x -> output`` of an elementwise layer whose backward hands the relevance on unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        """Return ``box[0]``."""
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The identity."""
        return grad, None


class NormFunction(torch.autograd.Function):
    """``x -> f(x)`` of a linear layer without parameters (average pooling): ``R_in = x * f^T(R_out / stab(f(x)))``.

    zennit's ``Norm`` rule; ``f^T`` is taken by autograd through ``f`` recomputed in the backward (pooling is cheap).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, box: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor], eps: float
    ) -> torch.Tensor:
        """Return ``box[0]``; keep ``x``, ``fn`` and the stabilised output."""
        ctx.save_for_backward(x)
        ctx.fn = fn
        ctx.den = stabilize(box[0], eps)
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """The Norm step."""
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            (adjoint,) = torch.autograd.grad(ctx.fn(leaf), leaf, grad / ctx.den)
        return x * adjoint, None, None, None


class SumFunction(torch.autograd.Function):
    """``(a, b) -> output`` of a residual block ``output = act(a + b)``: ``R_a = a R / stab(a + b)``, likewise ``b``.

    zennit's ``Norm`` rule on the canonized sum, with its ``Pass`` rule on the activation after it.
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, box: list[torch.Tensor], eps: float) -> torch.Tensor:
        """Return ``box[0]`` (the block's output); keep ``a``, ``b`` and the stabilised sum."""
        ctx.save_for_backward(a, b)
        ctx.eps = eps
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """The Norm step onto both summands."""
        a, b = ctx.saved_tensors
        s = grad / stabilize(a + b, ctx.eps)
        return a * s, b * s, None, None
