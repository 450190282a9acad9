"""GradientShap: expected gradients between the inputs and baselines drawn from a set, as captum defines them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import nn

from .._results import AttributionsWithDelta
from ..targets import Target, check_target, target_scores
from . import _math
from ._baselines import Baseline, check_inputs, check_model, reference_set
from ._passes import checked, gradient_pass, halves, outputs, repeated, resolved


@dataclass(frozen=True)
class Draws:
    """The random draws of one call, ``samples`` per item, item-major: ``(batch * samples,)`` rows."""

    index: torch.Tensor
    """Which baseline each row uses, ``(batch * samples,)``."""
    alpha: torch.Tensor
    """Where on the segment from the baseline to the (noisy) input the gradient is taken, ``(batch * samples,)``."""
    noise: torch.Tensor | None
    """Gaussian noise added to the inputs, ``(batch * samples, ...)``; ``None`` for ``stdevs=0``."""


def draw(batch: int, samples: int, references: int, item: tuple[int, ...], stdevs: float, seed: int) -> Draws:
    """The draws of :class:`GradientShap`: from a CPU generator seeded with ``seed``, in float64.

    Baseline indices first (``torch.randint``), then the noise (``torch.randn``, only for ``stdevs > 0``), then the
    positions (``torch.rand``); the same for any dtype and device of the inputs.

    Example:
        >>> d = draw(batch=2, samples=3, references=4, item=(5,), stdevs=0.0, seed=0)
        >>> d.index.shape, d.alpha.shape, d.noise is None
        (torch.Size([6]), torch.Size([6]), True)
    """
    generator = torch.Generator().manual_seed(seed)
    rows = batch * samples
    index = torch.randint(references, (rows,), generator=generator)
    noise = None
    if stdevs > 0:
        noise = torch.randn((rows, *item), generator=generator, dtype=torch.float64) * stdevs
    alpha = torch.rand(rows, generator=generator, dtype=torch.float64)
    return Draws(index, alpha, noise)


class GradientShap:
    """GradientShap (Lundberg & Lee, 2017, https://arxiv.org/abs/1705.07874): expected gradients, as captum's.

    For each item ``x`` and each of ``samples`` draws: a baseline ``b`` drawn from ``baselines``, the input with
    Gaussian noise ``x' = x + N(0, stdevs^2)`` and ``alpha ~ U(0, 1)``; the attributions are the mean over the draws
    of ``(x' - b) * dS/dx (alpha x' + (1 - alpha) b)``. One forward and backward of ``batch * samples`` rows.
    The draws come from a generator seeded with ``seed`` at every call (:func:`draw`), so a call is reproducible;
    captum draws with numpy and ``torch.normal`` instead (its result for the same draws agrees to rounding).

    Args:
        model: the network.
        baselines: the references: ``(n, ...)`` items, one item, a number, or a callable ``inputs -> baselines``.
        samples: draws per item.
        stdevs: the standard deviation of the noise added to the inputs (0: none).
        seed: the seed of the draws.
        multiply_by_inputs: ``(x' - b) * gradient`` (``True``, captum's default) or the gradient alone.

    The delta of ``return_delta=True`` is the mean over the draws of ``sum(attributions) - (S(x') - S(b))``
    (captum returns the ``batch * samples`` values; this is their mean per item). ``target=None`` is each item's
    top class for the clean input; a callable ``target`` is called on the outputs of the ``batch * samples`` rows.

    Example:
        >>> import torch
        >>> from attribution import GradientShap
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> GradientShap(model, torch.randn(10, 3), samples=8)(torch.randn(2, 3), target=1).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        baselines: Baseline,
        samples: int = 5,
        stdevs: float = 0.0,
        seed: int = 0,
        multiply_by_inputs: bool = True,
    ) -> None:
        self.model = check_model(model)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"`samples` must be an integer >= 1; got {samples!r}")
        if not stdevs >= 0:
            raise ValueError(f"`stdevs` must be >= 0 (the noise's standard deviation); got {stdevs!r}")
        self.baselines = baselines
        self.samples = samples
        self.stdevs = float(stdevs)
        self.seed = seed
        self.multiply_by_inputs = multiply_by_inputs

    @overload
    def __call__(
        self, inputs: torch.Tensor, target: Target = ..., *, return_delta: Literal[False] = ...
    ) -> torch.Tensor: ...

    @overload
    def __call__(
        self, inputs: torch.Tensor, target: Target = ..., *, return_delta: Literal[True]
    ) -> AttributionsWithDelta: ...

    def __call__(
        self, inputs: torch.Tensor, target: Target = None, *, return_delta: bool = False
    ) -> torch.Tensor | AttributionsWithDelta:
        """The attributions, shaped like ``inputs`` (with ``return_delta``, and the deltas ``(batch,)``)."""
        x = check_inputs(inputs, "GradientShap")
        batch = x.shape[0]
        check_target(target, batch)
        refs = reference_set(self.baselines, x)
        d = draw(batch, self.samples, refs.shape[0], tuple(x.shape[1:]), self.stdevs, self.seed)
        xs = x.repeat_interleave(self.samples, dim=0)
        if d.noise is not None:
            xs = xs + d.noise.to(device=x.device, dtype=x.dtype)
        bs = refs[d.index.to(refs.device)]
        alpha = d.alpha.to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
        if target is None:
            target = resolved(None, outputs(self.model, "GradientShap", x), batch)
        rows = repeated(target, self.samples)
        grad = gradient_pass(self.model, "GradientShap", alpha * xs + (1.0 - alpha) * bs, rows)
        pairs = (xs - bs) * grad if self.multiply_by_inputs else grad
        attributions = checked(_math.mean_over_references(pairs, batch), "GradientShap")
        if not return_delta:
            return attributions
        out_x, out_b = halves(outputs(self.model, "GradientShap", torch.cat([xs, bs])), xs.shape[0])
        gain = target_scores(out_x, rows, xs.shape[0]) - target_scores(out_b, rows, xs.shape[0])
        delta = _math.mean_over_references(pairs.flatten(1).sum(1) - gain, batch)
        return AttributionsWithDelta(attributions, delta)

    def __repr__(self) -> str:
        return f"GradientShap({type(self.model).__name__}, samples={self.samples}, stdevs={self.stdevs:g})"
