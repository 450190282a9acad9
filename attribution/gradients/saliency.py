"""Saliency (the gradient, or its magnitude) and Input x Gradient, at the input or at a layer's output."""

from __future__ import annotations

import builtins

import torch
from torch import nn

from ..targets import Target, check_target
from ._base import GradientMethod
from ._site import check_inputs, check_result, site_gradient


class Saliency(GradientMethod):
    """Saliency (Simonyan et al., 2014, https://arxiv.org/abs/1312.6034): ``|dS/dx|``, or ``dS/dx`` with ``abs=False``.

    ``S`` is the target score of each item (:mod:`attribution.targets`). Same as captum's ``Saliency`` (and, with
    ``layer``, the gradient at that module's output, shaped like it).

    Args:
        model: the network.
        abs: the gradient's absolute value (``True``, as in the paper and captum) or the signed gradient.
        layer: ``None`` (attributions at the input) or the module whose output is attributed.

    Example:
        >>> import torch
        >>> from attribution import Saliency
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
        >>> Saliency(model, abs=False)(torch.ones(1, 3), target=0)
        tensor([[ 1.0000, -2.0000,  0.5000]])
    """

    def __init__(self, model: nn.Module, abs: bool = True, *, layer: str | nn.Module | None = None) -> None:
        super().__init__(model, layer=layer)
        self.abs = abs

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The (absolute) gradient of the target scores, shaped like ``inputs`` (or like the layer's output)."""
        x = check_inputs(inputs, "Saliency", self.model, layer=self.layer)
        check_target(target, x.shape[0])
        grad = site_gradient(self.model, "Saliency", x, target, layer=self.layer).grad
        return check_result(builtins.abs(grad) if self.abs else grad, "Saliency")


class InputXGradient(GradientMethod):
    """Input x Gradient (Shrikumar et al., 2016, https://arxiv.org/abs/1605.01713): ``x * dS/dx``.

    With ``layer``, the layer's output times the gradient there (captum's ``LayerGradientXActivation``).

    Args:
        model: the network.
        layer: ``None`` (attributions at the input) or the module whose output is attributed.

    Example:
        >>> import torch
        >>> from attribution import InputXGradient
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
        >>> InputXGradient(model)(torch.tensor([[2.0, 1.0, -4.0]]), target=0)
        tensor([[ 2., -2., -2.]])
    """

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """``x * dS/dx`` (or the layer's output times the gradient there), shaped like it."""
        x = check_inputs(inputs, "InputXGradient", self.model, layer=self.layer)
        check_target(target, x.shape[0])
        site = site_gradient(self.model, "InputXGradient", x, target, layer=self.layer)
        return check_result(site.value * site.grad, "InputXGradient")
