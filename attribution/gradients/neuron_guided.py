"""NeuronGuidedBackprop: Guided Backprop's modified gradient of one neuron of a layer (captum's name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._run import warn
from ._base import GradientMethod
from ._site import check_inputs, check_result, layer_tensor, site_gradient
from .guided import DEFAULT_ACTIVATIONS, activation_names, modify_activations
from .neuron import Neuron, neuron_scores


class NeuronGuidedBackprop(GradientMethod):
    """Guided Backprop of one neuron of ``layer`` with respect to the inputs (captum's ``NeuronGuidedBackprop``).

    The gradient of the neuron's value, except that at each ReLU module between the inputs and the neuron only
    positive gradients pass back, and only where the unit was active (:class:`~attribution.GuidedBackprop`'s rule).
    If ``layer`` is itself a ReLU, its rule applies to the neuron's own gradient too, as in captum.

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output holds the neuron.
        activations: the module types whose backward is changed (``nn.ReLU`` and ``nn.ReLU6`` by default).

    Example:
        >>> import torch
        >>> from attribution import NeuronGuidedBackprop
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        ...     _ = model[2].weight.copy_(torch.tensor([[2.0, -3.0]]))
        >>> NeuronGuidedBackprop(model, "2")(torch.tensor([[1.0, 1.0]]), (0,))
        tensor([[2., 0.]])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        *,
        activations: Sequence[type[nn.Module]] = DEFAULT_ACTIVATIONS,
    ) -> None:
        super().__init__(model, layer=layer)
        self.activations = tuple(activations)

    def __call__(self, inputs: torch.Tensor, neuron: Neuron) -> torch.Tensor:
        """The guided gradient of ``neuron`` (an index into one item of the layer's output, or a callable).

        Args:
            inputs: ``(batch, ...)`` floating-point inputs.
            neuron: an index tuple into one item of the layer's output (batch axis left out), or a callable
                ``layer_output -> (batch,)``.

        Returns:
            ``(batch, ...)`` attributions, shaped like ``inputs``.
        """
        method = "NeuronGuidedBackprop"
        x = check_inputs(inputs, method, self.model, layer=None)
        names = activation_names(self.model, self.activations)
        if not names:
            kinds = ", ".join(t.__name__ for t in self.activations)
            warn(f"{method}: the model has no {kinds} module, so the result is the neuron's plain gradient")
        seen: list[torch.Tensor] = []
        layer = self.layer
        assert layer is not None

        def setup(group: HookGroup) -> None:
            modify_activations(group, names, "guided")  # first: a ReLU layer's neuron is read after its rule

            def keep(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
                seen.append(layer_tensor(output, name, call))

            group.forward(layer, keep)

        grad = site_gradient(self.model, method, x, lambda output: neuron_scores(seen[0], neuron), setup=setup).grad
        return check_result(grad, method)
