"""Neuron attributions (captum's ``Neuron*`` names): what one unit of a layer's output owes to each input feature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from ._base import GradientMethod
from ._site import check_inputs, check_result, layer_tensor, site_gradient

Neuron = tuple[int, ...] | int | Callable[[torch.Tensor], torch.Tensor]


def neuron_scores(layer_output: torch.Tensor, neuron: Neuron) -> torch.Tensor:
    """The ``(batch,)`` values of ``neuron`` (an index into one item of ``layer_output``, or a callable)."""
    if callable(neuron):
        return neuron(layer_output)
    index: tuple[int, ...] = (neuron,) if isinstance(neuron, int) else tuple(int(i) for i in neuron)
    item = tuple(layer_output.shape[1:])
    if len(index) != len(item) or any(not -n <= i < n for i, n in zip(index, item, strict=True)):
        raise IndexError(
            f"`neuron` {index} is not an index into one item of the layer's output, shaped {item}: give one index per "
            "axis (batch axis left out) within those sizes, or a callable layer_output -> (batch,)"
        )
    where: tuple[slice | int, ...] = (slice(None), *index)
    return layer_output[where]


class NeuronGradient(GradientMethod):
    """The gradient of one neuron of ``layer`` with respect to the inputs (captum's ``NeuronGradient``).

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output holds the neuron.

    Example:
        >>> import torch
        >>> from attribution import NeuronGradient
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.ReLU())
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
        >>> NeuronGradient(model, "0")(torch.ones(1, 3), (1,))
        tensor([[0., 1., 1.]])
    """

    def __init__(self, model: nn.Module, layer: str | nn.Module) -> None:
        super().__init__(model, layer=layer)

    def __call__(self, inputs: torch.Tensor, neuron: Neuron) -> torch.Tensor:
        """``d neuron / d inputs``, shaped like ``inputs``."""
        x = check_inputs(inputs, "NeuronGradient", self.model, layer=None)
        assert self.layer is not None
        grad = neuron_input_gradient(self.model, "NeuronGradient", self.layer, x, neuron)
        return check_result(grad, "NeuronGradient")


def neuron_input_gradient(
    model: nn.Module,
    method: str,
    layer: str,
    inputs: torch.Tensor,
    neuron: Neuron,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward and backward: ``d (scale * neuron) / d inputs``, ``scale`` a ``(batch,)`` weight per row."""
    seen: list[torch.Tensor] = []

    def record(group: HookGroup) -> None:
        def keep(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
            seen.append(layer_tensor(output, name, call))

        group.forward(layer, keep)

    def score(output: Any) -> torch.Tensor:
        values = neuron_scores(seen[0], neuron)
        return values if scale is None else values * scale

    return site_gradient(model, method, inputs, score, setup=record).grad
