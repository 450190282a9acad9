"""Neuron attributions along the inputs' path: neuron conductance and neuron Integrated Gradients (captum's names).

Both integrate, over the nodes and weights of ``method`` on ``x_k = b + a_k (x - b)``, the gradient of one neuron
``y_n`` of ``layer`` with respect to the inputs. Neuron Integrated Gradients explains the neuron itself, ``(x - b)
sum_k w_k dy_n/dx(x_k)``; neuron conductance explains the target's flow through the neuron, ``(x - b) sum_k w_k
dF/dy_n(x_k) dy_n/dx(x_k)``, so that its sum over the inputs tends to the neuron's layer conductance. With
``multiply_by_inputs=False`` the factor ``(x - b)`` is left out (captum's option).
"""

from __future__ import annotations

import torch
from torch import nn

from ..targets import Target, check_target
from ._base import GradientMethod
from ._quadrature import integrate, nodes_and_weights, nodes_per_forward
from ._site import check_inputs, check_result, layer_outputs, repeat_target, resolved_target, site_gradient
from .integrated import Baseline, Method, checked_path, expanded_baseline
from .neuron import Neuron, neuron_input_gradient, neuron_scores


def path_integral(
    m: NeuronConductance | NeuronIntegratedGradients, name: str, x: torch.Tensor, neuron: Neuron, target: Target
) -> torch.Tensor:
    """``[(x - b)] sum_k w_k [dF/dy_n(x_k)] dy_n/dx(x_k)``: the bracketed factors as ``m`` says (a conductance)."""
    assert m.layer is not None
    layer = m.layer

    def gradient(path: torch.Tensor, k: int) -> torch.Tensor:
        scale = None
        if isinstance(m, NeuronConductance):  # the target's gradient at the neuron weighs each row
            at_layer = site_gradient(m.model, name, path, repeat_target(target, k), layer=layer).grad
            scale = neuron_scores(at_layer, neuron).detach()
        return neuron_input_gradient(m.model, name, layer, path, neuron, scale).view(k, *x.shape)

    base = expanded_baseline(m.baseline, x)
    alphas, weights = nodes_and_weights(m.method, m.steps)
    total = integrate(gradient, base, x, alphas, weights, nodes_per_forward(m.internal_batch_size, m.steps, len(x)))
    return check_result(total * (x - base) if m.multiply_by_inputs else total, name)


class NeuronConductance(GradientMethod):
    """Neuron conductance (Dhamdhere et al., 2018, https://arxiv.org/abs/1805.12233), captum's ``NeuronConductance``.

    ``cond_i(x) = (x_i - b_i) sum_k w_k dF/dy_n(x_k) dy_n/dx_i(x_k)``: how much of the target flows from input
    ``i`` through the neuron ``n`` of ``layer``. Summed over the inputs it tends to the neuron's
    :class:`LayerConductance`. captum's default rule here is ``"riemann_trapezoid"``; ours is ``"gausslegendre"``
    as for every path method (pass ``method=`` to match captum).

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output holds the neuron.
        steps: the number of nodes on the path.
        method: the quadrature rule, as :class:`~attribution.IntegratedGradients` takes it.
        baseline: the path's start in the space of ``inputs``, as :class:`~attribution.IntegratedGradients` takes it.
        internal_batch_size: at most this many rows (items x nodes) per forward, at least one node; ``None``: one.
        multiply_by_inputs: multiply by ``x - b`` (captum's default); ``False`` leaves the integral alone.

    Example:
        >>> import torch
        >>> from attribution import NeuronConductance
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> NeuronConductance(model, "1", steps=20)(torch.randn(2, 3), (1,), target=0).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        steps: int = 50,
        method: Method = "gausslegendre",
        baseline: Baseline = None,
        internal_batch_size: int | None = None,
        multiply_by_inputs: bool = True,
    ) -> None:
        super().__init__(model, layer=layer)
        self.steps, self.method, self.baseline, self.internal_batch_size = checked_path(
            steps, method, baseline, internal_batch_size
        )
        self.multiply_by_inputs = multiply_by_inputs

    def __call__(self, inputs: torch.Tensor, neuron: Neuron, target: Target = None) -> torch.Tensor:
        """The conductance of ``neuron`` (an index into one item of the layer's output, or a callable) per input."""
        x = check_inputs(inputs, "NeuronConductance", self.model, layer=None)
        check_target(target, x.shape[0])
        if target is None:
            target = resolved_target(target, layer_outputs(self.model, "NeuronConductance", x, None)[0], x.shape[0])
        return path_integral(self, "NeuronConductance", x, neuron, target)


class NeuronIntegratedGradients(GradientMethod):
    """Integrated Gradients of one neuron of ``layer`` (captum's ``NeuronIntegratedGradients``).

    ``IG_i(x) = (x_i - b_i) sum_k w_k dy_n/dx_i(x_k)``; an item's attributions sum to about ``y_n(x) - y_n(b)``.

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output holds the neuron.
        steps: the number of nodes on the path.
        method: the quadrature rule, as :class:`~attribution.IntegratedGradients` takes it.
        baseline: the path's start in the space of ``inputs``, as :class:`~attribution.IntegratedGradients` takes it.
        internal_batch_size: at most this many rows (items x nodes) per forward, at least one node; ``None``: one.
        multiply_by_inputs: multiply by ``x - b`` (captum's default); ``False`` leaves the integral alone.

    Example:
        >>> import torch
        >>> from attribution import NeuronIntegratedGradients
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
        >>> NeuronIntegratedGradients(model, "1", steps=20)(torch.randn(2, 3), (2,)).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        steps: int = 50,
        method: Method = "gausslegendre",
        baseline: Baseline = None,
        internal_batch_size: int | None = None,
        multiply_by_inputs: bool = True,
    ) -> None:
        super().__init__(model, layer=layer)
        self.steps, self.method, self.baseline, self.internal_batch_size = checked_path(
            steps, method, baseline, internal_batch_size
        )
        self.multiply_by_inputs = multiply_by_inputs

    def __call__(self, inputs: torch.Tensor, neuron: Neuron) -> torch.Tensor:
        """The Integrated Gradients of ``neuron`` (an index into one item of the layer's output, or a callable)."""
        x = check_inputs(inputs, "NeuronIntegratedGradients", self.model, layer=None)
        return path_integral(self, "NeuronIntegratedGradients", x, neuron, None)
