"""Shapley values of features: exact over all coalitions, or sampled over random permutations (captum's estimator)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..targets import Target
from ._base import PerturbationMethod
from ._continuation import Continuation
from ._evaluate import nan_items
from ._masks import Baseline

MAX_EXACT_FEATURES = 10
"""The most features :class:`ShapleyValues` takes: ``2^M`` perturbations per item."""


def coalitions(count: int) -> torch.Tensor:
    """Every coalition of ``count`` features, ``(2^M, M)`` booleans: row ``r`` holds ``i`` if bit ``i`` of ``r`` is set.

    Example:
        >>> coalitions(2).int()
        tensor([[0, 0],
                [1, 0],
                [0, 1],
                [1, 1]], dtype=torch.int32)
    """
    return (torch.arange(2**count)[:, None] >> torch.arange(count)) & 1 == 1


def exact_shapley(values: torch.Tensor, count: int) -> torch.Tensor:
    """Shapley values ``(batch, M)`` from the value of every coalition ``(batch, 2^M)`` (indexed as :func:`coalitions`).

    ``phi_i = sum_{S not holding i} |S|! (M - |S| - 1)! / M! (v(S + i) - v(S))``.

    Example:
        >>> exact_shapley(torch.tensor([[0.0, 1.0, 2.0, 4.0]]), 2)   # v = x1 + 2 x2 + x1 x2
        tensor([[1.5000, 2.5000]])
    """
    rows = torch.arange(2**count)
    sizes = coalitions(count).sum(1)
    weights = torch.tensor(
        [math.factorial(s) * math.factorial(count - s - 1) / math.factorial(count) for s in range(count)],
        dtype=torch.float64,
    )
    out = []
    for i in range(count):
        without = rows[(rows >> i) & 1 == 0]
        w = weights[sizes[without]].to(values)
        out.append(((values[:, without + (1 << i)] - values[:, without]) * w).sum(1))
    return torch.stack(out, 1)


def permutation_chains(permutations: torch.Tensor) -> torch.Tensor:
    """The coalitions along each permutation, ``(n, M - 1, M)``: after its first ``1 .. M-1`` features are added.

    Example:
        >>> permutation_chains(torch.tensor([[2, 0, 1]])).int()
        tensor([[[0, 0, 1],
                 [1, 0, 1]]], dtype=torch.int32)
    """
    n, count = permutations.shape
    rank = torch.empty_like(permutations)
    rank.scatter_(1, permutations, torch.arange(count).expand(n, count).contiguous())  # the step adding each feature
    return rank[:, None, :] <= torch.arange(count - 1)[None, :, None]


class ShapleyValues(PerturbationMethod):
    """Exact Shapley values of ``M <= 10`` features (Shapley, 1953; Strumbelj & Kononenko, 2010).

    ``phi_i = sum_S |S|! (M - |S| - 1)! / M! (S(x_{S+i}) - S(x_S))`` over the coalitions ``S`` without ``i``, where
    ``x_S`` is the input with the features outside ``S`` at the baseline; given to every element of feature ``i``.
    Every coalition is evaluated once: ``2^M - 1`` perturbed rows per item (captum's ``ShapleyValues`` runs
    ``M! M``, the same average over all permutations). Above 10 features use ``ShapleyValueSampling``.

    Args:
        model: the network.
        feature_mask: ``None`` (one feature per element) or an integer tensor broadcastable to one item, ids
            ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable.
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        reuse: reuse a causal language model's unperturbed keys/values.
        show_progress: a progress bar on a terminal for calls that take more than a second.

    Example:
        >>> import torch
        >>> from attribution import ShapleyValues
        >>> class Product(torch.nn.Module):
        ...     def forward(self, x):
        ...         return (x[:, :1] * x[:, 1:2] + x[:, 2:]).expand(-1, 2)
        >>> ShapleyValues(Product())(torch.tensor([[2.0, 3.0, 1.0]]), target=0)
        tensor([[3., 3., 1.]])
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
    ) -> None:
        super().__init__(
            model,
            baseline=baseline,
            feature_mask=feature_mask,
            perturbations_per_forward=perturbations_per_forward,
            reuse=reuse,
            show_progress=show_progress,
        )

    def __call__(self, inputs: torch.Tensor, target: Target | Continuation = None) -> torch.Tensor:
        """The attributions, shaped like ``inputs``."""
        x, single = self._inputs(inputs)
        ids, count = self._features(x)
        if count > MAX_EXACT_FEATURES:
            raise ValueError(
                f"ShapleyValues evaluates all 2^M coalitions and takes at most {MAX_EXACT_FEATURES} features; the "
                f"`feature_mask` gives {count}. Use ShapleyValueSampling(model, feature_mask, samples=...) instead, "
                "or group the elements into fewer features"
            )
        with self._evaluator(x, target) as run:
            scores = run.keep(coalitions(count)[:-1], ids)  # the last coalition, every feature, is the input
        self.forwards = run.forwards
        values = torch.cat([scores, run.full[:, None]], 1)
        attributions = nan_items(exact_shapley(values, count)[:, ids], values, "ShapleyValues")
        return run.result(attributions, single)


class ShapleyValueSampling(PerturbationMethod):
    """Shapley values estimated over ``samples`` random permutations (Castro et al., 2009), captum's estimator.

    For each permutation the features are added to the baseline one at a time, in its order; a feature's sample is
    the change of the target score when it is added. Its attribution is the mean over the permutations, given to
    each of its elements. ``samples (M - 1) + 1`` perturbed rows per item. The permutations are
    ``torch.randperm(M)`` of a generator seeded with ``seed``: captum's, when captum runs after
    ``torch.manual_seed(seed)``.

    Args:
        model: the network.
        feature_mask: ``None`` (one feature per element) or an integer tensor broadcastable to one item, ids
            ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable.
        samples: the number of permutations.
        seed: the seed of the permutations.
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        reuse: reuse a causal language model's unperturbed keys/values.
        show_progress: a progress bar on a terminal for calls that take more than a second.
        layer: ``None`` (the inputs), or one module (its name, or the module) whose output is perturbed instead:
            the feature mask and the baseline then apply to one item of its output ``(batch, *item)``, the
            attributions are shaped like that output, and the model runs up to the layer once (later forwards
            replay that part and run only what follows; see ``docs/methods/perturbation.rst``).

    Example:
        >>> import torch
        >>> from attribution import ShapleyValueSampling
        >>> model = torch.nn.Linear(3, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
        >>> ShapleyValueSampling(model, samples=4)(torch.tensor([[2.0, 1.0, -4.0]]), target=0)
        tensor([[ 2., -2., -2.]])
    """

    def __init__(
        self,
        model: nn.Module,
        feature_mask: torch.Tensor | None = None,
        baseline: Baseline = None,
        samples: int = 25,
        seed: int = 0,
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
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"`samples` must be an integer >= 1; got {samples!r}")
        self.samples = samples
        self.seed = seed

    def __call__(self, inputs: torch.Tensor, target: Target | Continuation = None) -> torch.Tensor:
        """The attributions, shaped like ``inputs`` (like the layer's output with ``layer``)."""
        x, single = self._inputs(inputs)
        with self._evaluator(x, target) as run:
            ids, count = self._features(run.units)
            generator = torch.Generator().manual_seed(self.seed)
            permutations = torch.stack([torch.randperm(count, generator=generator) for _ in range(self.samples)])
            chains = permutation_chains(permutations)  # (n, M - 1, M)
            keep = torch.cat([torch.zeros(1, count, dtype=torch.bool), chains.flatten(0, 1)])
            scores = run.keep(keep, ids)
        self.forwards = run.forwards
        batch, n = len(run.full), self.samples  # items, or items x continuation tokens
        empty, steps = scores[:, :1], scores[:, 1:].reshape(batch, n, count - 1)
        chain = torch.cat(
            [empty.expand(batch, n).unsqueeze(2), steps, run.full.view(batch, 1, 1).expand(batch, n, 1)], 2
        )
        gains = chain.diff(dim=2)  # (batch, n, M): the gain of the feature added at each step
        total = gains.new_zeros(batch, count)
        total.scatter_add_(1, permutations.to(gains.device).flatten()[None].expand(batch, -1), gains.flatten(1))
        values = torch.cat([run.full[:, None], scores], 1)
        attributions = nan_items((total / n)[:, ids], values, "ShapleyValueSampling")
        return run.result(attributions, single)
