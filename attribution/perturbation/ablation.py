"""Feature ablation: each feature set to the baseline on its own, the target's drop given to its elements."""

from __future__ import annotations

import torch
from torch import nn

from ..targets import Target
from ._base import PerturbationMethod
from ._continuation import Continuation
from ._evaluate import nan_items
from ._masks import Baseline


class FeatureAblation(PerturbationMethod):
    """Feature ablation: ``S(x) - S(x with feature i at the baseline)``, given to every element of feature ``i``.

    ``S`` is the target score (:mod:`attribution.targets`; for a language model an integer target is the
    log-probability of that token at the last position). ``M`` features cost ``M`` perturbed rows per item, plus
    the unperturbed one. Same as captum's ``FeatureAblation``; with token ids and ``reuse=True`` a perturbation that
    starts at token ``i`` runs only tokens ``i..T-1`` on the unperturbed keys/values (see
    ``docs/methods/perturbation.rst``).

    Args:
        model: the network.
        feature_mask: ``None`` (one feature per element, per token for token ids) or an integer tensor
            broadcastable to one item, ids ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable (see
            ``docs/methods/perturbation.rst``).
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        reuse: reuse a causal language model's unperturbed keys/values.
        show_progress: a progress bar on a terminal for calls that take more than a second.
        layer: ``None`` (the inputs), or one module (its name, or the module) whose output is perturbed instead:
            the feature mask and the baseline then apply to one item of its output ``(batch, *item)``, the
            attributions are shaped like that output, and the model runs up to the layer once (later forwards
            replay that part and run only what follows; see ``docs/methods/perturbation.rst``).

    Example:
        >>> import torch
        >>> from attribution import FeatureAblation
        >>> model = torch.nn.Linear(3, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
        >>> FeatureAblation(model)(torch.tensor([[2.0, 1.0, -4.0]]), target=0)
        tensor([[ 2., -2., -2.]])
    """

    def __init__(
        self,
        model: nn.Module,
        feature_mask: torch.Tensor | None = None,
        baseline: Baseline = None,
        *,
        perturbations_per_forward: int | None = None,
        reuse: bool = True,
        show_progress: bool = True,
        layer: str | nn.Module | None = None,
    ) -> None:
        super().__init__(
            model,
            baseline=baseline,
            feature_mask=feature_mask,
            perturbations_per_forward=perturbations_per_forward,
            reuse=reuse,
            show_progress=show_progress,
            layer=layer,
        )

    def __call__(self, inputs: torch.Tensor, target: Target | Continuation = None) -> torch.Tensor:
        """The attributions, shaped like ``inputs`` (like the layer's output with ``layer``)."""
        x, single = self._inputs(inputs)
        with self._evaluator(x, target) as run:
            ids, count = self._features(run.units)
            scores = run.keep(~torch.eye(count, dtype=torch.bool), ids)
        self.forwards = run.forwards
        attributions = (run.full[:, None] - scores)[:, ids]
        attributions = nan_items(attributions, torch.cat([run.full[:, None], scores], 1), "FeatureAblation")
        return run.result(attributions, single)
