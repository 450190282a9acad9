"""KernelSHAP (Lundberg & Lee, 2017): Shapley values as the solution of a weighted linear regression on coalitions."""

from __future__ import annotations

import torch
from torch import nn

from ..targets import Target
from ._base import PerturbationMethod
from ._continuation import Continuation
from ._evaluate import nan_items
from ._masks import Baseline
from ._regression import shapley_kernel, weighted_least_squares
from .shapley import coalitions


def sampled_coalitions(count: int, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``(samples, M)`` coalitions drawn from the Shapley kernel, each then weighing 1.

    A size ``k`` with probability proportional to ``(M - 1) / (k (M - k))``, then ``k`` features uniformly.
    """
    k = torch.arange(1, count, dtype=torch.float64)
    chosen = torch.multinomial((count - 1) / (k * (count - k)), samples, replacement=True, generator=generator) + 1
    order = torch.rand(samples, count, generator=generator).argsort(1)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(count).expand(samples, count).contiguous())
    return rank < chosen[:, None]


def kernel_shap_solution(
    keep: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, empty: torch.Tensor, full: torch.Tensor
) -> torch.Tensor:
    """Shapley values ``(batch, M)`` by KernelSHAP's regression, ``sum phi = v(full) - v(empty)`` held exactly.

    ``keep`` ``(n, M)`` are the coalitions (neither empty nor full), ``weights`` ``(n,)`` their kernel weights,
    ``values`` ``(batch, n)`` their values; the last feature is eliminated through the constraint.
    """
    z = keep.double().to(values.device)
    gain = (full - empty).double()  # (batch,)
    target = values.double() - empty.double()[:, None] - z[None, :, -1] * gain[:, None]
    phi = weighted_least_squares(z[:, :-1] - z[:, -1:], target, weights.to(values.device))
    return torch.cat([phi, gain[:, None] - phi.sum(1, keepdim=True)], 1)


class KernelSHAP(PerturbationMethod):
    """KernelSHAP (Lundberg & Lee, 2017, https://arxiv.org/abs/1705.07874): the weighted regression of SHAP.

    The Shapley values ``phi`` minimise ``sum_z pi(z) (S(x_z) - S(x_0) - phi . z)^2`` over coalitions ``z`` of the
    ``M`` features, with ``sum phi = S(x) - S(x_0)`` held exactly (``x_z``: the features outside ``z`` at the
    baseline) and the Shapley kernel ``pi(z) = (M - 1) / (C(M, |z|) |z| (M - |z|))``. With ``samples >= 2^M - 2``
    every coalition is evaluated once with its exact weight and the result equals ``ShapleyValues``; with
    fewer, coalitions are drawn from the kernel (a size, then the features uniformly) and weigh 1 each.

    Args:
        model: the network.
        feature_mask: ``None`` (one feature per element) or an integer tensor broadcastable to one item, ids
            ``0..M-1``.
        baseline: ``None`` (0, or for token ids the pad token), a number, a tensor or a callable.
        samples: coalitions to evaluate; ``None``: ``2 M + 2048`` (shap's ``"auto"``), all when that is at least
            ``2^M - 2``.
        seed: the seed of the sampled coalitions.
        perturbations_per_forward: perturbations per model call; ``None``: as many as fit the memory budget.
        reuse: reuse a causal language model's unperturbed keys/values.
        show_progress: a progress bar on a terminal for calls that take more than a second.

    Example:
        >>> import torch
        >>> from attribution import KernelSHAP
        >>> class Product(torch.nn.Module):
        ...     def forward(self, x):
        ...         return (x[:, :1] * x[:, 1:2] + x[:, 2:]).expand(-1, 2)
        >>> KernelSHAP(Product())(torch.tensor([[2.0, 3.0, 1.0]]), target=0).round(decimals=4)
        tensor([[3., 3., 1.]])
    """

    def __init__(
        self,
        model: nn.Module,
        feature_mask: torch.Tensor | None = None,
        baseline: Baseline = None,
        samples: int | None = None,
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
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise ValueError(f"`samples` must be None or an integer >= 1; got {samples!r}")
        self.samples = samples
        self.seed = seed

    def __call__(self, inputs: torch.Tensor, target: Target | Continuation = None) -> torch.Tensor:
        """The attributions, shaped like ``inputs``."""
        x, single = self._inputs(inputs)
        ids, count = self._features(x)
        keep, weights = self._coalitions(count)
        with self._evaluator(x, target) as run:
            scores = run.keep(torch.cat([torch.zeros(1, count, dtype=torch.bool), keep]), ids)
        self.forwards = run.forwards
        empty, values = scores[:, 0], scores[:, 1:]
        if count == 1:
            phi = (run.full - empty)[:, None].double()
        else:
            phi = kernel_shap_solution(keep, weights, values, empty, run.full)
        attributions = nan_items(phi.to(scores.dtype)[:, ids], torch.cat([run.full[:, None], scores], 1), "KernelSHAP")
        return run.result(attributions, single)

    def _coalitions(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The coalitions to evaluate ``(n, M)`` and their regression weights ``(n,)``."""
        if count == 1:
            return torch.zeros(0, 1, dtype=torch.bool), torch.zeros(0, dtype=torch.float64)
        wanted = 2 * count + 2048 if self.samples is None else self.samples
        if count < 62 and wanted >= 2**count - 2:
            every = coalitions(count)[1:-1]
            return every, shapley_kernel(every.sum(1), count)
        generator = torch.Generator().manual_seed(self.seed)
        return sampled_coalitions(count, wanted, generator), torch.ones(wanted, dtype=torch.float64)
