"""NeuronDeepLift: DeepLIFT's Rescale rule from one neuron of a layer back to the inputs (captum's name)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import nn

from hooks import resolve

from .._results import AttributionsWithDelta
from ..gradients.neuron import Neuron, neuron_scores
from . import _math
from ._baselines import Baseline, baseline_like, check_inputs
from ._passes import checked, deeplift_pass
from .deeplift import DeepLift


class NeuronDeepLift(DeepLift):
    """DeepLIFT (Rescale rule) of one neuron of ``layer`` with respect to the inputs (captum's ``NeuronDeepLift``).

    :class:`~attribution.DeepLift` with the neuron's value in place of the target score: the inputs and the
    baselines run as one batch, every nonlinearity's gradient is replaced by its DeepLIFT multiplier, and the
    attributions are ``(x - baseline) * m``, ``m`` the multiplier of the neuron with respect to the input. On networks
    of linear layers, elementwise activations and max pools the attributions of an item add up to
    ``neuron(x) - neuron(baseline)``; ``return_delta=True`` reports the difference (captum's ``NeuronDeepLift`` has no
    delta). The model's modules after the layer run too and need a rule (as for :class:`~attribution.DeepLift`).

    Args:
        model: the network (as for :class:`~attribution.DeepLift`).
        layer: the module (its name, or the module) whose output holds the neuron.
        baseline: the reference, as for :class:`~attribution.DeepLift` (default 0).
        multiply_by_inputs: return ``(x - baseline) * m`` (``True``, captum's default) or the multipliers ``m``.
        eps: as for :class:`~attribution.DeepLift`.

    Example:
        >>> import torch
        >>> from attribution import NeuronDeepLift
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU())
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, -1.0], [2.0, 1.0]]))
        >>> NeuronDeepLift(model, "1", baseline=torch.tensor([0.0, 2.0]))(torch.tensor([[3.0, 1.0]]), (0,))
        tensor([[1.5000, 0.5000]])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        baseline: Baseline = 0.0,
        multiply_by_inputs: bool = True,
        *,
        eps: float = _math.EPS,
    ) -> None:
        super().__init__(model, baseline, multiply_by_inputs, eps=eps)
        found = resolve(self.model, layer, what="`layer`")
        if len(found) != 1:
            names = [name for name, _ in found]
            raise ValueError(f"NeuronDeepLift: `layer` must name one module; {layer!r} names {len(found)}: {names[:6]}")
        self.layer: str = found[0][0]

    @overload  # type: ignore[override]
    def __call__(self, inputs: torch.Tensor, neuron: Neuron, *, return_delta: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def __call__(
        self, inputs: torch.Tensor, neuron: Neuron, *, return_delta: Literal[True]
    ) -> AttributionsWithDelta: ...

    def __call__(
        self, inputs: torch.Tensor, neuron: Neuron, *, return_delta: bool = False
    ) -> torch.Tensor | AttributionsWithDelta:
        """The attributions of ``neuron``'s value, shaped like ``inputs``.

        Args:
            inputs: ``(batch, ...)`` floating-point inputs.
            neuron: an index tuple into one item of the layer's output (batch axis left out), or a callable
                ``layer_output -> (batch,)``.
            return_delta: also return the convergence deltas ``sum(attributions) - (neuron(x) - neuron(baseline))``.

        Returns:
            ``(batch, ...)`` attributions, or with ``return_delta=True`` an
            :class:`~attribution.reference.AttributionsWithDelta` pair ``attributions, delta``.
        """
        x = check_inputs(inputs, "NeuronDeepLift")
        ref = baseline_like(self.baseline, x)

        def score(layer_output: torch.Tensor) -> torch.Tensor:
            return neuron_scores(layer_output, neuron)

        run = deeplift_pass(self.model, "NeuronDeepLift", x, ref, score, self.eps, layer=self.layer)
        attributions = checked((x - ref) * run.grad if self.multiply_by_inputs else run.grad, "NeuronDeepLift")
        if not return_delta:
            return attributions
        return AttributionsWithDelta(attributions, attributions.flatten(1).sum(1) - run.gain)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, layer={self.layer!r})"
