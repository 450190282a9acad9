"""Guided Backprop and Deconvolution: the gradient with the backward of the ReLU modules changed, through hooks.

The change is made for one call by forward hooks in the call's hook group (no class replacement, no patching):

* Guided Backprop: a ReLU's output ``y`` is replaced by ``PositiveGradient(y)`` (same values; backward ``max(g, 0)``),
  so that the ReLU's own backward then gives ``max(g, 0) * [x > 0]``: only positive gradients pass, where the unit
  was active (captum's ``relu(grad_input)``, equal since ``[x > 0]`` is 0 or 1).
* Deconvolution: the output is replaced by ``Deconvolved(x)`` (the ReLU's values; backward ``max(g, 0)`` straight to
  the ReLU's input, skipping its mask); for an in-place ReLU, a forward pre-hook keeps a copy of ``x`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookGroup

from .._run import warn
from ..targets import Target, check_target
from ._base import GradientMethod
from ._site import check_inputs, check_result, site_gradient

Rule = Literal["guided", "deconvolution"]
DEFAULT_ACTIVATIONS: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)


class PositiveGradient(torch.autograd.Function):
    """Identity forward (a copy); backward keeps the positive part of the gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.clamp(min=0)


class Deconvolved(torch.autograd.Function):
    """Forward: the activation's output ``y`` (given); backward: the positive part of the gradient, to ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad.clamp(min=0), None


def activation_names(model: nn.Module, activations: Sequence[type[nn.Module]]) -> list[str]:
    """The names of the model's modules of the given types, each module once, in model order."""
    seen: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, tuple(activations)) and id(module) not in seen:
            seen[id(module)] = name
    return list(seen.values())


def modify_activations(group: HookGroup, names: list[str], rule: Rule) -> None:
    """Register, in ``group``, the hooks that change the backward of the named activation modules by ``rule``."""
    if not names:
        return
    if rule == "guided":

        def guided(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return PositiveGradient.apply(output)

        group.forward(names, guided)
        return
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple[Any, ...], *, name: str, call: int) -> None:
        x = args[0]
        kept[(name, call)] = x.clone() if getattr(module, "inplace", False) and x.requires_grad else x

    def deconvolved(module: nn.Module, args: Any, output: torch.Tensor, *, name: str, call: int) -> torch.Tensor:
        x = kept.pop((name, call))
        return Deconvolved.apply(x, output.detach()) if x.requires_grad else output

    group.forward_pre(names, keep)
    group.forward(names, deconvolved)


class _ModifiedReLU(GradientMethod):
    """The gradient at the input with the backward of the activation modules changed by ``rule``."""

    rule: Rule

    def __init__(self, model: nn.Module, *, activations: Sequence[type[nn.Module]] = DEFAULT_ACTIVATIONS) -> None:
        super().__init__(model)
        self.activations = tuple(activations)

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The modified gradient of the target scores, shaped like ``inputs``."""
        method = type(self).__name__
        x = check_inputs(inputs, method, self.model, layer=None)
        check_target(target, x.shape[0])
        names = activation_names(self.model, self.activations)
        if not names:
            kinds = ", ".join(t.__name__ for t in self.activations)
            warn(
                f"{method}: the model has no {kinds} module, so nothing is changed and the result is the plain "
                "gradient. If the model calls torch.nn.functional.relu, it has no module to hook: pass the types it "
                "does use as `activations=`"
            )
        grad = site_gradient(
            self.model, method, x, target, setup=lambda group: modify_activations(group, names, self.rule)
        ).grad
        return check_result(grad, method)


class GuidedBackprop(_ModifiedReLU):
    """Guided Backpropagation (Springenberg et al., 2015, https://arxiv.org/abs/1412.6806).

    The gradient of the target score, except that at each ReLU only positive gradients pass back, and only where
    the unit was active: ``R_in = max(R_out, 0) * [x > 0]``. Same as captum's ``GuidedBackprop``, which changes
    ``nn.ReLU`` modules; here ``nn.ReLU6`` too by default (``activations=``), and like captum, ReLUs called as
    functions (``torch.nn.functional.relu``) are not changed.

    Args:
        model: the network.
        activations: the module types whose backward is changed.

    Example:
        >>> import torch
        >>> from attribution import GuidedBackprop
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        ...     _ = model[2].weight.copy_(torch.tensor([[2.0, -3.0]]))
        >>> GuidedBackprop(model)(torch.tensor([[1.0, 1.0]]), target=0)
        tensor([[2., 0.]])
    """

    rule: Rule = "guided"


class Deconvolution(_ModifiedReLU):
    """Deconvolution (Zeiler & Fergus, 2014, https://arxiv.org/abs/1311.2901).

    The gradient of the target score, except that each ReLU passes back the positive part of the gradient whatever
    its input was: ``R_in = max(R_out, 0)``. Same as captum's ``Deconvolution``; the same ``activations`` as
    :class:`GuidedBackprop`.

    Args:
        model: the network.
        activations: the module types whose backward is changed.

    Example:
        >>> import torch
        >>> from attribution import Deconvolution
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        ...     _ = model[2].weight.copy_(torch.tensor([[2.0, -3.0]]))
        >>> Deconvolution(model)(torch.tensor([[-1.0, 1.0]]), target=0)
        tensor([[2., 0.]])
    """

    rule: Rule = "deconvolution"
