"""Integrated Gradients, at the input or at a layer's output, with captum's quadrature rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch
from torch import nn

from .._results import AttributionsWithDelta
from ..targets import Target, check_target
from ._base import GradientMethod
from ._quadrature import check_rule, integrate, nodes_and_weights, nodes_per_forward
from ._site import check_inputs, check_result, layer_outputs, repeat_target, resolved_target, site_gradient, with_delta

Baseline = None | float | torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
Method = Literal["gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid"]


class IntegratedGradients(GradientMethod):
    """Integrated Gradients (Sundararajan et al., 2017, https://arxiv.org/abs/1703.01365).

    ``IG_i(x) = (x_i - b_i) int_0^1 dS/dx_i (b + a (x - b)) da``, the integral replaced by ``sum_k w_k g(a_k)``
    with the nodes and weights of ``method`` (captum's rules, see ``docs/methods/gradients.rst``). With
    ``layer``, the path runs between the layer's outputs for the baseline and for the input, the model running on
    the input with that layer's output replaced (captum's ``LayerIntegratedGradients``): for a language model,
    ``layer`` is the embedding module and ``inputs`` may be token ids.

    Completeness: the attributions of an item sum to ``S(x) - S(b)`` up to the quadrature error, which
    ``return_delta=True`` reports as ``delta = sum(attributions) - (S(x) - S(b))``, one value per item.

    Args:
        model: the network.
        steps: the number of nodes on the path (at least 1; 2 for ``"riemann_trapezoid"``).
        method: the quadrature rule: ``"gausslegendre"`` (default), ``"riemann_left"``, ``"riemann_right"``,
            ``"riemann_middle"`` or ``"riemann_trapezoid"``.
        baseline: the path's start, in the space of ``inputs`` (also with ``layer``: token ids for a language
            model): ``None`` (zeros), a number, a tensor shaped like ``inputs``, like one item or ``(1, ...)``, or a
            callable ``inputs -> baseline``.
        internal_batch_size: at most this many rows (items x steps) per forward; at least one step per forward.
            ``None`` runs all steps in one forward.
        layer: ``None`` (attributions at the input) or the module whose output is attributed.

    Example:
        >>> import torch
        >>> from attribution import IntegratedGradients
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Tanh())
        >>> x = torch.randn(2, 3)
        >>> attributions, delta = IntegratedGradients(model, steps=20)(x, target=0, return_delta=True)
        >>> attributions.shape, bool(delta.abs().max() < 1e-4)
        (torch.Size([2, 3]), True)
    """

    def __init__(
        self,
        model: nn.Module,
        steps: int = 50,
        method: Method = "gausslegendre",
        baseline: Baseline = None,
        internal_batch_size: int | None = None,
        *,
        layer: str | nn.Module | None = None,
    ) -> None:
        super().__init__(model, layer=layer)
        self.steps, self.method, self.baseline, self.internal_batch_size = checked_path(
            steps, method, baseline, internal_batch_size
        )

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
        """The attributions, shaped like ``inputs`` (or the layer's output).

        With ``return_delta=True``, an :class:`~attribution.reference.AttributionsWithDelta` pair instead:
        ``attributions, delta = ig(x, return_delta=True)``, ``delta`` of shape ``(batch,)``.
        """
        x = check_inputs(inputs, "IntegratedGradients", self.model, layer=self.layer)
        batch = x.shape[0]
        check_target(target, batch)
        base = self._baseline(x)
        needs_ends = self.layer is not None or return_delta or (target is None)
        ends = None
        if needs_ends:  # forwards of inputs and baselines: the ends of the path, the top classes, S(x) and S(b)
            out_x, end = layer_outputs(self.model, "IntegratedGradients", x, self.layer)
            out_b, start = layer_outputs(self.model, "IntegratedGradients", base, self.layer)
            ends = (out_x, out_b)
            target = resolved_target(target, out_x, batch)
        else:
            start, end = base, x
        total = self._integral(x, start, end, target)
        attributions = check_result(total * (end - start), "IntegratedGradients")
        if not return_delta:
            return attributions
        assert ends is not None
        return with_delta(attributions, ends, target, batch)

    def _integral(self, x: torch.Tensor, start: torch.Tensor, end: torch.Tensor, target: Target) -> torch.Tensor:
        """``sum_k w_k dS/ds (start + a_k (end - start))``, in chunks of steps."""

        def gradient(path: torch.Tensor, k: int) -> torch.Tensor:
            tgt = repeat_target(target, k)
            if self.layer is None:
                grad = site_gradient(self.model, "IntegratedGradients", path, tgt).grad
            else:
                repeated = x.repeat(k, *([1] * (x.dim() - 1)))
                run = site_gradient(self.model, "IntegratedGradients", repeated, tgt, layer=self.layer, value=path)
                grad = run.grad
            return grad.view(k, *end.shape)

        alphas, weights = nodes_and_weights(self.method, self.steps)
        per = nodes_per_forward(self.internal_batch_size, self.steps, x.shape[0])
        return integrate(gradient, start, end, alphas, weights, per)

    def _baseline(self, x: torch.Tensor) -> torch.Tensor:
        """The baseline, expanded to the shape of ``x`` (checked)."""
        return expanded_baseline(self.baseline, x)


def checked_path(
    steps: int, method: Method, baseline: Baseline, internal_batch_size: int | None, nodes: int | None = None
) -> tuple[int, Method, Baseline, int | None]:
    """A path method's four settings, checked (``nodes``: the rule's node count, ``steps`` if None).

    Integrated Gradients and the layer and neuron path methods take the same four settings.
    """
    check_rule(method, steps if nodes is None else nodes)
    check_batch_size(internal_batch_size)
    return steps, method, baseline, internal_batch_size


def check_batch_size(internal_batch_size: int | None) -> None:
    """Reject an ``internal_batch_size`` that is neither ``None`` nor a positive integer."""
    if internal_batch_size is not None and (isinstance(internal_batch_size, bool) or internal_batch_size < 1):
        raise ValueError(f"`internal_batch_size` must be None or at least 1; got {internal_batch_size!r}")


def expanded_baseline(given: Baseline, x: torch.Tensor) -> torch.Tensor:
    """The baseline ``given`` (as ``baseline=`` takes it), expanded to the shape of ``x`` (checked)."""
    if given is None:
        return torch.zeros_like(x)
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return torch.full_like(x, given)
    base = given(x) if callable(given) else given
    what = "the baseline that `baseline` returned" if callable(given) else "`baseline`"
    if not isinstance(base, torch.Tensor):
        raise TypeError(f"{what} must be a tensor; got {type(base).__name__}")
    if tuple(base.shape) not in (tuple(x.shape), tuple(x.shape[1:]), (1, *x.shape[1:])):
        raise ValueError(
            f"{what} has shape {tuple(base.shape)}, but `inputs` are {tuple(x.shape)}: give a baseline shaped like "
            f"`inputs`, like one item {tuple(x.shape[1:])}, or (1, ...), or a number"
        )
    if base.is_floating_point() != x.is_floating_point():
        raise TypeError(f"{what} is {base.dtype} but `inputs` are {x.dtype}: give a baseline of the inputs' kind")
    return base.to(device=x.device, dtype=x.dtype).expand_as(x).clone()
