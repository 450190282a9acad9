"""LIME (Ribeiro et al., 2016): a linear surrogate fitted on random binary perturbations near the input."""

from __future__ import annotations

import torch
from torch import nn

from ..targets import Target
from ._base import PerturbationMethod
from ._continuation import Continuation
from ._evaluate import nan_items
from ._masks import Baseline
from ._regression import binary_cosine_kernel, cosine_kernel, weighted_least_squares


class LIME(PerturbationMethod):
    """LIME (Ribeiro et al., 2016, https://arxiv.org/abs/1602.04938) with captum's default sampling and kernel.

    ``samples`` binary vectors ``z`` over the ``M`` features are drawn with each feature on with probability 1/2;
    ``x_z`` is the input with the features that are off at the baseline. A linear surrogate ``S(x_z) ~ c . z + c_0``
    is fitted by weighted least squares with the weights ``exp(-d^2 / (2 kernel_width^2))``, ``d`` the cosine
    distance between ``x`` and ``x_z`` (for token ids: between the all-ones vector and ``z``, as captum's
    ``LLMAttribution``). A feature's coefficient is given to each of its elements. Unlike captum, whose default
    surrogate is a Lasso (``alpha=0.01``), the fit is unregularised (minimum-norm where underdetermined).

    Args:
        model: the network.
        feature_mask: ``None`` (one feature per element) or an integer tensor broadcastable to one item, ids
            ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable.
        samples: the number of perturbations.
        kernel_width: the width of the exponential kernel on the cosine distance.
        seed: the seed of the perturbations.
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        reuse: reuse a causal language model's unperturbed keys/values.
        show_progress: a progress bar on a terminal for calls that take more than a second.

    Example:
        >>> import torch
        >>> from attribution import LIME
        >>> model = torch.nn.Linear(3, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
        >>> LIME(model, samples=30)(torch.tensor([[2.0, 1.0, -4.0]]), target=0).round(decimals=4)
        tensor([[ 2., -2., -2.]])
    """

    def __init__(
        self,
        model: nn.Module,
        feature_mask: torch.Tensor | None = None,
        baseline: Baseline = None,
        samples: int = 50,
        kernel_width: float = 1.0,
        seed: int = 0,
        *,
        perturbations_per_forward: int | None = None,
        reuse: bool = True,
        show_progress: bool = True,
    ) -> None:
        super().__init__(
            model,
            baseline=baseline,
            feature_mask=feature_mask,
            perturbations_per_forward=perturbations_per_forward,
            reuse=reuse,
            show_progress=show_progress,
        )
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"`samples` must be an integer >= 1; got {samples!r}")
        if not kernel_width > 0:
            raise ValueError(f"`kernel_width` must be positive; got {kernel_width!r}")
        self.samples = samples
        self.kernel_width = float(kernel_width)
        self.seed = seed

    def __call__(self, inputs: torch.Tensor, target: Target | Continuation = None) -> torch.Tensor:
        """The attributions (the surrogate's coefficients), shaped like ``inputs``."""
        x, single = self._inputs(inputs)
        ids, count = self._features(x)
        generator = torch.Generator().manual_seed(self.seed)
        keep = torch.rand(self.samples, count, generator=generator) < 0.5
        with self._evaluator(x, target) as run:
            scores = run.keep(keep, ids)
            base = run.baseline
        self.forwards = run.forwards
        if x.is_floating_point():
            weights = cosine_kernel(x, base, ids, keep, self.kernel_width)
        else:
            weights = binary_cosine_kernel(keep, self.kernel_width)
        coefficients = weighted_least_squares(keep, scores, weights, intercept=True)[:, :-1]
        values = torch.cat([run.full[:, None], scores], 1)
        attributions = nan_items(coefficients.to(scores.dtype)[:, ids], values, "LIME")
        return run.result(attributions, single)
