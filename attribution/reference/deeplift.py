"""DeepLIFT with the Rescale rule (:class:`DeepLift`) and its mean over a set of references (:class:`DeepLiftShap`)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import nn

from .._results import AttributionsWithDelta
from ..targets import Target, check_target
from . import _math
from ._baselines import Baseline, baseline_like, check_inputs, check_model, reference_set
from ._passes import checked, deeplift_pass, repeated


class DeepLift:
    """DeepLIFT with the Rescale rule (Shrikumar et al., 2017, https://arxiv.org/abs/1704.02685), as captum's.

    The inputs and the baselines run as one batch; every nonlinearity's gradient is replaced by its DeepLIFT
    multiplier (:mod:`attribution.reference.rules`: Rescale for elementwise activations, captum's max-pool rule,
    a softmax rule, LayerNorm/RMSNorm with the scale held constant, the average rule on a gated MLP's
    ``act(gate(x)) * up(x)``), and the attributions are
    ``(x - baseline) * m``, ``m`` the multiplier of the target score ``S`` with respect to the input. Linear layers
    keep their gradient. For ``nn.ReLU``/``Sigmoid``/``Tanh``/``ELU``/``LeakyReLU``/``Softplus`` networks with
    ``nn.MaxPool`` this is captum's ``DeepLift`` (to rounding), also for modules called several times (captum
    refuses those).

    Summation to delta: the attributions of an item add up to ``S(x) - S(baseline)`` exactly on networks of
    linear layers, elementwise activations and max pools; ``return_delta=True`` reports the difference per item in
    every case. Activations called as functions inside a module's ``forward`` (``torch.relu(x)``) are not seen:
    they keep their gradient, and the delta shows it.

    Args:
        model: the network; nonlinear modules no rule covers (adaptive max pools, ``nn.MultiheadAttention``, ...)
            are refused at the call.
        baseline: the reference: a number, a tensor shaped like the inputs, like one item or ``(1, ...)``, or a
            callable ``inputs -> baseline``. Default 0.
        multiply_by_inputs: return ``(x - baseline) * m`` (``True``, captum's default) or the multipliers ``m``.
        eps: below this ``|x - r|`` at a nonlinearity, its gradient is used instead of the ratio (captum's 1e-10).

    Example:
        >>> import torch
        >>> from attribution import DeepLift
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> attributions, delta = DeepLift(model)(torch.randn(5, 3), target=1, return_delta=True)
        >>> attributions.shape, bool(delta.abs().max() < 1e-5)
        (torch.Size([5, 3]), True)
    """

    def __init__(
        self, model: nn.Module, baseline: Baseline = 0.0, multiply_by_inputs: bool = True, *, eps: float = _math.EPS
    ) -> None:
        self.model = check_model(model)
        self.baseline = baseline
        self.multiply_by_inputs = multiply_by_inputs
        self.eps = float(eps)

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
        """The attributions of ``target``'s score, shaped like ``inputs``.

        Args:
            inputs: ``(batch, ...)`` floating-point inputs.
            target: ``None`` (each item's top class), a class, one class per item, or a callable
                ``output -> (batch,)`` scores (:mod:`attribution.targets`).
            return_delta: also return the convergence deltas.

        Returns:
            ``(batch, ...)`` attributions, or with ``return_delta=True`` an
            :class:`~attribution.reference.AttributionsWithDelta` pair, ``attributions, delta = ...`` (also
            ``.attributions``, ``.delta``; ``delta`` of shape ``(batch,)``).
        """
        x = check_inputs(inputs, "DeepLift")
        check_target(target, x.shape[0])
        ref = baseline_like(self.baseline, x)
        run = deeplift_pass(self.model, "DeepLift", x, ref, target, self.eps)
        attributions = checked((x - ref) * run.grad if self.multiply_by_inputs else run.grad, "DeepLift")
        if not return_delta:
            return attributions
        return AttributionsWithDelta(attributions, attributions.flatten(1).sum(1) - run.gain)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"


class DeepLiftShap(DeepLift):
    """DeepLIFT averaged over a set of references (Lundberg & Lee, 2017, https://arxiv.org/abs/1705.07874), as captum.

    For each item and each of the ``n`` baselines, :class:`DeepLift`'s attributions; their mean over the baselines.
    The items run against all baselines in one batch of ``2 * batch * n`` rows (item-major, as captum), so memory
    grows with ``n``. The attributions of an item sum to ``S(x) - mean_j S(b_j)`` on the networks where DeepLift's
    sum is exact; the delta is ``sum(attributions) - (S(x) - mean_j S(b_j))``, the mean of the per-baseline deltas.

    Args:
        model: the network (as for :class:`DeepLift`).
        baselines: the references: ``(n, ...)`` items (``n >= 1``), one item, a number, or a callable
            ``inputs -> baselines``.
        multiply_by_inputs: as for :class:`DeepLift`.
        eps: as for :class:`DeepLift`.

    A callable ``target`` is called on the outputs of the expanded batch (``batch * n`` items, item-major).

    Example:
        >>> import torch
        >>> from attribution import DeepLiftShap
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> DeepLiftShap(model, torch.randn(6, 3))(torch.randn(2, 3), target=0).shape
        torch.Size([2, 3])
    """

    def __init__(
        self, model: nn.Module, baselines: Baseline, multiply_by_inputs: bool = True, *, eps: float = _math.EPS
    ) -> None:
        super().__init__(model, baselines, multiply_by_inputs, eps=eps)

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
        """The mean over the baselines of DeepLift's attributions (see :meth:`DeepLift.__call__`)."""
        x = check_inputs(inputs, "DeepLiftShap")
        batch = x.shape[0]
        check_target(target, batch)
        refs = reference_set(self.baseline, x)
        n = refs.shape[0]
        xs = x.repeat_interleave(n, dim=0)
        rs = refs.repeat(batch, *([1] * (refs.dim() - 1)))
        run = deeplift_pass(self.model, "DeepLiftShap", xs, rs, repeated(target, n), self.eps)
        pairs = (xs - rs) * run.grad if self.multiply_by_inputs else run.grad
        attributions = checked(_math.mean_over_references(pairs, batch), "DeepLiftShap")
        if not return_delta:
            return attributions
        delta = _math.mean_over_references(pairs.flatten(1).sum(1) - run.gain, batch)
        return AttributionsWithDelta(attributions, delta)
