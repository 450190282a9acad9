"""NeuronFeatureAblation: each feature set to the baseline on its own, the change of one neuron of a layer.

The perturbed batches run through :class:`~attribution.FeatureAblation`'s evaluator on :class:`UpToLayer`, a view of
the model whose output is the layer's output: each forward stops once the layer has run (an exception raised by the
recording hook, caught by the view), so the modules after the layer never run. The layer's output is the same as in
a full forward, so the attributions equal captum's, which runs the whole model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hooks import HookManager

from .._run import SiteTypeError, SiteValueError, did_not_run
from ..gradients.neuron import Neuron, neuron_scores
from ._layer import check_layer
from ._masks import Baseline, default_token
from .ablation import FeatureAblation


class _Stop(Exception):
    """Raised by the recording hook once the layer has run: the rest of the forward is not needed."""


class UpToLayer(nn.Module):
    """The model run up to ``layer``; the output is the layer's output (the model's own state is untouched).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> UpToLayer(model, "1")(torch.zeros(4, 2)).shape
        torch.Size([4, 3])
    """

    def __init__(self, model: nn.Module, layer: str) -> None:
        super().__init__()
        self.model, self.layer = model, layer

    def forward(self, inputs: Any) -> torch.Tensor:  # noqa: D102
        seen: list[torch.Tensor] = []

        def keep(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
            if call > 0:
                raise SiteValueError(f"`layer` {name!r} ran twice in one forward: choose a module that runs once")
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                got = f"{output.dtype} tensor" if isinstance(output, torch.Tensor) else type(output).__name__
                raise SiteTypeError(f"`layer` {name!r} returned a {got}; name a submodule that returns a float tensor")
            seen.append(output)
            raise _Stop

        with HookManager(self.model) as manager:
            manager.group("NeuronFeatureAblation.layer").forward(self.layer, keep)
            try:
                self.model(inputs)
            except _Stop:
                pass
        if not seen:
            raise did_not_run("`layer`", self.layer)
        return seen[0]


class NeuronFeatureAblation:
    """Feature ablation of one neuron of ``layer`` (captum's ``NeuronFeatureAblation``).

    ``N(x) - N(x with feature i at the baseline)``, ``N`` the neuron's value, given to every element of feature
    ``i``; :class:`~attribution.FeatureAblation` with the neuron in place of the target score. ``M`` features cost
    ``M`` perturbed rows per item, plus the unperturbed one, batched ``perturbations_per_forward`` at a time, and every
    forward stops at the layer (the modules after it do not run).

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output holds the neuron; it must run once per forward.
        feature_mask: ``None`` (one feature per element) or an integer tensor broadcastable to one item, ids
            ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable, as for
            :class:`~attribution.FeatureAblation`.
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        show_progress: a progress bar on a terminal for calls that take more than a second.

    Example:
        >>> import torch
        >>> from attribution import NeuronFeatureAblation
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.ReLU())
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
        >>> NeuronFeatureAblation(model, "1")(torch.tensor([[2.0, 1.0, -4.0]]), (1,))
        tensor([[ 0.,  0., -1.]])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        feature_mask: torch.Tensor | None = None,
        baseline: Baseline = None,
        *,
        perturbations_per_forward: int | None = None,
        show_progress: bool = True,
    ) -> None:
        # checked as FeatureAblation checks them (the model, its eager module, perturbations_per_forward)
        ablation = FeatureAblation(model, feature_mask, baseline, perturbations_per_forward=perturbations_per_forward)
        name = check_layer(ablation.model, layer, "NeuronFeatureAblation")
        assert name is not None
        self.model, self.layer = ablation.model, name
        self.feature_mask, self.baseline = feature_mask, baseline
        self.perturbations_per_forward = perturbations_per_forward
        self.show_progress = show_progress
        self.forwards = 0  # the model calls of the last call

    def __call__(self, inputs: torch.Tensor, neuron: Neuron) -> torch.Tensor:
        """The attributions of ``neuron``'s value, shaped like ``inputs``.

        Args:
            inputs: ``(batch, ...)`` floating-point inputs, or token ids.
            neuron: an index tuple into one item of the layer's output (batch axis left out), or a callable
                ``layer_output -> (batch,)``.
        """
        baseline = self.baseline
        if baseline is None and isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            baseline = default_token(self.model)  # the view has no config: the model's pad token, read here
        ablation = FeatureAblation(
            UpToLayer(self.model, self.layer),
            self.feature_mask,
            baseline,
            perturbations_per_forward=self.perturbations_per_forward,
            reuse=False,
            show_progress=self.show_progress,
        )

        def score(layer_output: torch.Tensor) -> torch.Tensor:
            return neuron_scores(layer_output, neuron)

        attributions = ablation(inputs, score)
        self.forwards = ablation.forwards
        return attributions

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, layer={self.layer!r})"
