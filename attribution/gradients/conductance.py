"""Layer conductance and internal influence: a layer's share of the target along the input's straight path.

Both walk the path ``x_k = b + a_k (x - b)`` of the *inputs* (captum's rules, :mod:`._quadrature`) and take the
gradient of the target at ``layer``'s output ``y``. Internal influence integrates that gradient,
``sum_k w_k dF/dy(x_k)``; conductance weighs it by the layer's own steps, ``sum_k dF/dy(x_k) . (y(x_{k+1}) -
y(x_k))`` over ``steps + 1`` nodes (captum's ``LayerConductance``: the nodes of ``method`` for ``steps + 1``, their
weights unused), so that its sum over the layer tends to ``F(x) - F(b)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, overload

import torch
from torch import nn

from .._results import AttributionsWithDelta
from ..targets import Target, check_target
from ._base import GradientMethod
from ._quadrature import integrate, nodes_and_weights, nodes_per_forward, path_chunks
from ._site import check_inputs, check_result, layer_outputs, repeat_target, resolved_target, site_gradient, with_delta
from .integrated import Baseline, Method, checked_path, expanded_baseline


def layer_path(
    model: nn.Module,
    method: str,
    layer: str,
    start: torch.Tensor,
    end: torch.Tensor,
    alphas: torch.Tensor,
    target: Target,
    per: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dF/dy, y)`` at ``layer``, each ``(k, batch, ...)``, on ``start + a (end - start)``, ``per`` a forward."""
    batch = end.shape[0]
    for nodes, path in path_chunks(start, end, alphas, per):
        k = nodes.stop - nodes.start
        run = site_gradient(model, method, path, repeat_target(target, k), layer=layer)
        yield run.grad.view(k, batch, *run.grad.shape[1:]), run.value.view(k, batch, *run.value.shape[1:])


def conductance_sum(steps: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum_k g_k . (y_{k+1} - y_k)`` over chunks of ``(g, y)`` nodes, the last node's gradient unused."""
    total: torch.Tensor | None = None
    last: tuple[torch.Tensor, torch.Tensor] | None = None
    for grad, value in steps:
        if last is not None:
            grad, value = torch.cat([last[0][None], grad]), torch.cat([last[1][None], value])
        part = (grad[:-1] * (value[1:] - value[:-1])).sum(0)
        total = part if total is None else total + part
        last = grad[-1], value[-1]
    assert total is not None
    return total


class LayerConductance(GradientMethod):
    """Layer conductance (Dhamdhere et al., 2018, https://arxiv.org/abs/1805.12233), captum's ``LayerConductance``.

    ``cond_j(x) = sum_k dF/dy_j(x_k) (y_j(x_{k+1}) - y_j(x_k))`` over the ``steps + 1`` nodes ``x_k = b + a_k (x -
    b)`` of ``method`` (captum's convention: for ``"gausslegendre"`` the Gauss-Legendre nodes of ``steps + 1``, which
    do not reach 0 and 1). Completeness: an item's conductances sum to about ``F(x) - F(b)``; ``return_delta=True``
    reports ``sum(conductances) - (F(x) - F(b))`` per item.

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output units are attributed.
        steps: the number of steps on the path (``steps + 1`` nodes; at least 1).
        method: the rule whose nodes are used, as :class:`~attribution.IntegratedGradients` takes it.
        baseline: the path's start in the space of ``inputs``, as :class:`~attribution.IntegratedGradients` takes it.
        internal_batch_size: at most this many rows (items x nodes) per forward, at least one node; ``None``: one.

    Example:
        >>> import torch
        >>> from attribution import LayerConductance
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> x = torch.randn(2, 3)
        >>> conductance, delta = LayerConductance(model, "1", steps=50)(x, target=0, return_delta=True)
        >>> conductance.shape, bool(delta.abs().max() < 1e-3)
        (torch.Size([2, 4]), True)
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        steps: int = 50,
        method: Method = "gausslegendre",
        baseline: Baseline = None,
        internal_batch_size: int | None = None,
    ) -> None:
        super().__init__(model, layer=layer)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an integer of at least 1; got {steps!r}")
        self.steps, self.method, self.baseline, self.internal_batch_size = checked_path(
            steps,
            method,
            baseline,
            internal_batch_size,
            nodes=steps + 1,  # steps + 1 nodes, as captum
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
        """The conductance of each unit of the layer's output, shaped like it (or the pair with ``delta``)."""
        x = check_inputs(inputs, "LayerConductance", self.model, layer=None)
        batch = x.shape[0]
        check_target(target, batch)
        base = expanded_baseline(self.baseline, x)
        assert self.layer is not None
        ends = None
        if return_delta or target is None:
            ends = (
                layer_outputs(self.model, "LayerConductance", x, None)[0],
                layer_outputs(self.model, "LayerConductance", base, None)[0],
            )
            target = resolved_target(target, ends[0], batch)
        alphas = nodes_and_weights(self.method, self.steps + 1)[0]
        per = nodes_per_forward(self.internal_batch_size, self.steps + 1, batch)
        path = layer_path(self.model, "LayerConductance", self.layer, base, x, alphas, target, per)
        attributions = check_result(conductance_sum(path), "LayerConductance")
        if not return_delta:
            return attributions
        assert ends is not None
        return with_delta(attributions, ends, target, batch)


class InternalInfluence(GradientMethod):
    """Internal influence (Leino et al., 2018, https://arxiv.org/abs/1802.03788), captum's ``InternalInfluence``.

    ``infl_j(x) = sum_k w_k dF/dy_j(x_k)`` over the ``steps`` nodes and weights of ``method`` on the input path
    ``x_k = b + a_k (x - b)``: the gradient at the layer integrated along the inputs' path (not multiplied by any
    difference, so it does not sum to ``F(x) - F(b)``).

    Args:
        model: the network.
        layer: the module (its name, or the module) whose output units are attributed.
        steps: the number of nodes on the path.
        method: the quadrature rule, as :class:`~attribution.IntegratedGradients` takes it.
        baseline: the path's start in the space of ``inputs``, as :class:`~attribution.IntegratedGradients` takes it.
        internal_batch_size: at most this many rows (items x nodes) per forward, at least one node; ``None``: one.

    Example:
        >>> import torch
        >>> from attribution import InternalInfluence
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        >>> InternalInfluence(model, "0", steps=5)(torch.randn(2, 3), target=0).shape  # linear: the weights
        torch.Size([2, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        steps: int = 50,
        method: Method = "gausslegendre",
        baseline: Baseline = None,
        internal_batch_size: int | None = None,
    ) -> None:
        super().__init__(model, layer=layer)
        self.steps, self.method, self.baseline, self.internal_batch_size = checked_path(
            steps, method, baseline, internal_batch_size
        )

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The internal influence of each unit of the layer's output, shaped like it."""
        x = check_inputs(inputs, "InternalInfluence", self.model, layer=None)
        batch = x.shape[0]
        check_target(target, batch)
        base = expanded_baseline(self.baseline, x)
        assert self.layer is not None
        if target is None:
            target = resolved_target(target, layer_outputs(self.model, "InternalInfluence", x, None)[0], batch)

        def gradient(path: torch.Tensor, k: int) -> torch.Tensor:
            grad = site_gradient(self.model, "InternalInfluence", path, repeat_target(target, k), layer=self.layer).grad
            return grad.view(k, batch, *grad.shape[1:])

        alphas, weights = nodes_and_weights(self.method, self.steps)
        per = nodes_per_forward(self.internal_batch_size, self.steps, batch)
        total = integrate(gradient, base, x, alphas, weights, per)
        return check_result(total, "InternalInfluence")
