"""LRP rules: how one layer hands the relevance of its output down to its input.

A rule is a small object that a composite assigns to a layer (a convolution or a linear layer, with any batch norm
merged into it). During the forward pass, :meth:`attribution.lrp.Rule.prepare` receives the layer, its input ``x``
and its output ``z`` and returns the backward step ``R_out -> R_in``; :class:`~attribution.LRP` runs that step as
the layer's gradient, so the layer's own backward (and its weight gradients) never runs.

For a layer ``z = f(x; W, b)`` (``f`` affine in ``x``), with ``f^T(s; W)`` the gradient of ``f`` with respect to
its input at weights ``W`` (a transposed convolution, or ``s @ W``), ``x+ = max(x, 0)``, ``x- = min(x, 0)``,
``W+``/``W-`` likewise and ``stab(z) = z + eps * sign(z)`` (sign 1 at 0):

* :class:`Epsilon`: ``R_in = x * f^T(R_out / stab(z); W)``
* :class:`ZPlus`: ``R_in = x+ * f^T(s; W+) + x- * f^T(s; W-)``, ``s = R_out / stab(f(x+; W+, b+) + f(x-; W-, 0))``
* :class:`AlphaBeta`: ``alpha`` times the ZPlus term minus ``beta`` times the same with the signs of ``W`` swapped
* :class:`Gamma`: ZPlus with ``W + gamma W+`` for positive outputs and ``W + gamma W-`` for negative ones
* :class:`ZBox`: ``R_in = x f^T(s; W) - l f^T(s; W+) - h f^T(s; W-)``, ``s = R_out / stab(f(x) - f(l; W+) - f(h; W-))``
* :class:`WSquare`: ``R_in = f^T(R_out / stab(f(1; W^2, b^2)); W^2)``
* :class:`Flat`: ``R_in = f^T(R_out / stab(f(1; 1, 0)); 1)``

These are zennit 1.0's rules (same parameters, defaults and stabiliser), so the relevance agrees with zennit's
to rounding.

Example:
    >>> import torch
    >>> from attribution.lrp.rules import Epsilon, Layer
    >>> linear = torch.nn.Linear(3, 2).double()
    >>> x = torch.randn(4, 3, dtype=torch.float64)
    >>> step = Epsilon(epsilon=0.0).prepare(Layer.of(linear), x, linear(x).detach())
    >>> r_out = torch.randn(4, 2, dtype=torch.float64)
    >>> r_in = step(r_out, x)
    >>> r_in.shape
    torch.Size([4, 3])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AlphaBeta", "Epsilon", "Flat", "Gamma", "Layer", "Pass", "Rule", "WSquare", "ZBox", "ZPlus", "stabilize"]

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The backward step of a rule: ``(relevance at the output, layer input) -> relevance at the input``."""

_CONVS: dict[type[nn.Module], Callable[..., torch.Tensor]] = {
    nn.Conv1d: F.conv1d,
    nn.Conv2d: F.conv2d,
    nn.Conv3d: F.conv3d,
}


def stabilize(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``z + epsilon * sign(z)``, with sign 1 at 0 (zennit's stabiliser): a denominator that is never 0.

    Example:
        >>> stabilize(torch.tensor([-2.0, 0.0, 3.0]), 0.5)
        tensor([-2.5000,  0.5000,  3.5000])
    """
    shift = torch.where(z >= 0.0, z.new_tensor(epsilon), z.new_tensor(-epsilon))  # +-eps in z's dtype
    return z + shift  # two passes fewer than z + (sign(z) + (z == 0)) * eps


def positive(t: torch.Tensor) -> torch.Tensor:
    """``max(t, 0)``."""
    return t.clamp(min=0.0)


def negative(t: torch.Tensor) -> torch.Tensor:
    """``min(t, 0)``."""
    return t.clamp(max=0.0)


@dataclass(frozen=True)
class Layer:
    """An affine layer as the rules see it: ``f(x, W, b)``, its input gradient ``f^T(s, W, x)``, and ``W``, ``b``.

    ``weight`` and ``bias`` are the layer's own or, with a batch norm merged into it, the merged ones.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    adjoint: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    memo: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def derived(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, kept under ``key`` for as long as this layer object lives.

        :class:`~attribution.LRP` keeps it while the parameters are unchanged: modified weights are then computed
        once, not at every call.
        """
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @classmethod
    def of(
        cls, module: nn.Module, weight: torch.Tensor | None = None, bias: torch.Tensor | str | None = "same"
    ) -> Layer:
        """The layer of an ``nn.Linear`` or ``nn.Conv1d/2d/3d`` (or a subclass), with these weights if given."""
        own_weight, own_bias = module.weight, getattr(module, "bias", None)
        assert isinstance(own_weight, torch.Tensor)
        w = own_weight.detach() if weight is None else weight
        b_own = own_bias.detach() if isinstance(own_bias, torch.Tensor) else None
        b = b_own if isinstance(bias, str) else bias
        kind = type(module)
        if kind.forward is nn.Linear.forward:
            return cls(w, b, F.linear, _linear_adjoint)
        conv = next((fn for base, fn in _CONVS.items() if kind.forward is base.forward), None)
        if conv is not None and getattr(module, "padding_mode", "zeros") == "zeros" and module.padding != "same":
            options = (module.stride, module.padding, module.dilation, module.groups)
            return cls(w, b, _conv_forward(conv, options), _conv_adjoint(options))
        return cls(w, b, _generic_forward(module), _generic_adjoint(module))


def _linear_adjoint(s: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return s @ weight


def _conv_forward(conv: Callable[..., torch.Tensor], options: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return conv(x, weight, bias, *options)

    return forward


def _conv_adjoint(options: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
    stride, padding, dilation, groups = options

    def adjoint(s: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        grads = torch.ops.aten.convolution_backward(
            s, x, weight, None, stride, padding, dilation, False, [0] * len(stride), groups, [True, False, False]
        )
        return grads[0]

    return adjoint


def _generic_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    """``module.forward`` with other parameters (a conv subclass with its own forward, e.g. timm's Conv2dSame).

    It runs on a shallow copy of the module holding the given tensors, and without its hooks: the module itself is
    not touched.
    """
    kind = type(module)

    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        twin = copy.copy(module)
        params: dict[str, Any] = {**module._parameters, "weight": weight}
        own_bias = module._parameters.get("bias")
        if own_bias is not None:
            params["bias"] = bias if bias is not None else torch.zeros_like(own_bias)
        twin.__dict__["_parameters"] = params
        return kind.forward(twin, x)

    return forward


def _generic_adjoint(module: nn.Module) -> Callable[..., torch.Tensor]:
    forward = _generic_forward(module)

    def adjoint(s: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(forward(leaf, weight, None), leaf, s)
        return grad

    return adjoint


def _weight(layer: Layer, sign: str) -> torch.Tensor:
    """``W+`` (``sign="+"``) or ``W-`` of the layer, computed once per layer object."""
    return layer.derived(sign, lambda: positive(layer.weight) if sign == "+" else negative(layer.weight))


def _zero_like(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.zeros_like(t)


def _clamped(t: torch.Tensor | None, sign: int) -> torch.Tensor | None:
    return None if t is None else positive(t) if sign > 0 else negative(t)


class Rule:
    """Base class of the rules: :meth:`prepare` runs in the forward pass and returns the backward step."""

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """The step ``(R_out, x) -> R_in`` of this rule for a layer with input ``x`` and output ``z``.

        Args:
            layer: the layer (weights merged with a following batch norm where there is one).
            x: the layer's input, ``(batch, ...)``.
            z: the layer's output (before any activation), ``(batch, ...)``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Pass(Rule):
    """Hand the relevance on unchanged (zennit's ``Pass``): for elementwise layers such as activations.

    Assigned to a convolution or linear layer it would be wrong (shapes differ); composites give it to activations.

    Example:
        >>> Pass()
        Pass()
    """

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """The identity step."""
        return lambda r, x: r


class Epsilon(Rule):
    """LRP-epsilon (Bach et al. 2015): ``R_in = x * f^T(R_out / stab(z))``; ``epsilon=0`` is LRP-0.

    Args:
        epsilon: added to ``|z|`` in the denominator (default ``1e-6``, as zennit).

    Example:
        >>> Epsilon(0.25)
        Epsilon(epsilon=0.25)
    """

    def __init__(self, epsilon: float = 1e-6) -> None:
        self.epsilon = float(epsilon)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        den = stabilize(z, self.epsilon)
        return lambda r, x: x * layer.adjoint(r / den, layer.weight, x)


class ZPlus(Rule):
    """LRP-z+ (Montavon et al. 2017): positive contributions only, alpha=1, beta=0 (zennit's ``ZPlus``).

    Args:
        stabilizer: the ``epsilon`` of the denominator's stabiliser.

    Example:
        >>> ZPlus()
        ZPlus(stabilizer=1e-06)
    """

    def __init__(self, stabilizer: float = 1e-6) -> None:
        self.stabilizer = float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        split, w_pos = _Split.of(x), _weight(layer, "+")
        w_neg = partial(_weight, layer, "-")
        z_plus = _two_sided(layer, split, (w_pos, _clamped(layer.bias, 1)), w_neg)
        den = z_plus + self.stabilizer  # = stabilize(z_plus): z_plus >= 0 (x+ W+, x- W- and b+ are all >= 0)
        return lambda r, x: _spread(layer, split, r / den, w_pos, w_neg)


class AlphaBeta(Rule):
    """LRP-alpha-beta (Bach et al. 2015): ``alpha`` times the positive part minus ``beta`` times the negative part.

    Args:
        alpha: weight of the positive contributions; ``alpha - beta`` must be 1.
        beta: weight of the negative contributions.
        stabilizer: the ``epsilon`` of the denominators' stabiliser.

    Raises:
        ValueError: a negative ``alpha`` or ``beta``, or ``alpha - beta != 1``.

    Example:
        >>> AlphaBeta(2, 1)
        AlphaBeta(alpha=2.0, beta=1.0, stabilizer=1e-06)
    """

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6) -> None:
        if alpha < 0 or beta < 0 or alpha - beta != 1:
            raise ValueError(f"`alpha` and `beta` must be >= 0 with alpha - beta = 1; got alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.stabilizer = float(alpha), float(beta), float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        split = _Split.of(x)
        z_pos, z_neg = _parts(layer, split, z)
        scale_pos = z_pos.add_(self.stabilizer).reciprocal_().mul_(self.alpha)  # z+ >= 0: stab(z+) = z+ + eps
        scale_neg = z_neg.sub_(self.stabilizer).reciprocal_().mul_(-self.beta)
        first, second = (scale_pos, _weight(layer, "+")), (scale_neg, _weight(layer, "-"))
        return _paired_step(layer, split, first, second)


class Gamma(Rule):
    """Generalised LRP-gamma (Montavon et al. 2019; Andéol et al. 2021) as zennit 1.0 computes it.

    Positive outputs (``z > 0``) spread over ``x+ (W + gamma W+)`` and ``x- (W + gamma W-)``, negative outputs over
    ``x+ (W + gamma W-)`` and ``x- (W + gamma W+)``; biases get the same modification (zero in the ``x-`` terms).

    Args:
        gamma: how much of the positive (resp. negative) weights is added.
        stabilizer: the ``epsilon`` of the denominators' stabiliser.

    Example:
        >>> Gamma(gamma=0.5)
        Gamma(gamma=0.5, stabilizer=1e-06)
    """

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6) -> None:
        self.gamma, self.stabilizer = float(gamma), float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation.

        The denominators are ``z + gamma z+`` (positive outputs) and ``z + gamma z-`` (negative ones), with ``z+``
        and ``z-`` the positive and negative parts of the layer's output (see ``_parts``).
        """
        g, eps = self.gamma, self.stabilizer
        w_up = layer.derived(f"gamma {g} +", lambda: layer.weight + g * _weight(layer, "+"))
        w_down = layer.derived(f"gamma {g} -", lambda: layer.weight + g * _weight(layer, "-"))
        split = _Split.of(x)
        z_pos, z_neg = _parts(layer, split, z)
        up, down = z > 0.0, z < 0.0
        scale_pos = torch.add(z, z_pos, alpha=g).add_(eps).reciprocal_().masked_fill_(~up, 0.0)
        scale_neg = torch.add(z, z_neg, alpha=g).sub_(eps).reciprocal_().masked_fill_(~down, 0.0)
        return _paired_step(layer, split, (scale_pos, w_up), (scale_neg, w_down))


class ZBox(Rule):
    """LRP-z^B (Montavon et al. 2017) for inputs bounded by ``low`` and ``high`` (pixels), for the first layer.

    Args:
        low: the lowest input value: a number or a tensor broadcast to the input (e.g. ``(1, C, 1, 1)``).
        high: the highest input value, likewise.
        stabilizer: the ``epsilon`` of the denominator's stabiliser.

    Example:
        >>> ZBox(-1.0, 1.0)
        ZBox(low=-1.0, high=1.0, stabilizer=1e-06)
    """

    def __init__(self, low: float | torch.Tensor, high: float | torch.Tensor, stabilizer: float = 1e-6) -> None:
        self.low, self.high, self.stabilizer = low, high, float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        low = _bound(self.low, x, "low")
        high = _bound(self.high, x, "high")
        w_pos, w_neg = _weight(layer, "+"), _weight(layer, "-")
        b_pos, b_neg = _clamped(layer.bias, 1), _clamped(layer.bias, -1)
        z_low, z_high = layer.forward(low, w_pos, b_pos), layer.forward(high, w_neg, b_neg)
        den = stabilize(z - (z_low + z_high), self.stabilizer)

        def step(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            s = r / den
            terms = (
                x * layer.adjoint(s, layer.weight, x),
                low * layer.adjoint(s, w_pos, x),
                high * layer.adjoint(s, w_neg, x),
            )
            return terms[0] - (terms[1] + terms[2])

        return step


class WSquare(Rule):
    """LRP-w^2 (Montavon et al. 2017): relevance spread by squared weights, regardless of the input.

    Args:
        stabilizer: the ``epsilon`` of the denominator's stabiliser.

    Example:
        >>> WSquare()
        WSquare(stabilizer=1e-06)
    """

    def __init__(self, stabilizer: float = 1e-6) -> None:
        self.stabilizer = float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        w2 = layer.derived("square", lambda: layer.weight**2)
        b2 = None if layer.bias is None else layer.bias**2
        den = stabilize(layer.forward(torch.ones_like(x), w2, b2), self.stabilizer)
        return lambda r, x: layer.adjoint(r / den, w2, x)


class Flat(Rule):
    """LRP-flat (Lapuschkin et al. 2019): relevance spread uniformly over each output's receptive field.

    Args:
        stabilizer: the ``epsilon`` of the denominator's stabiliser.

    Example:
        >>> Flat()
        Flat(stabilizer=1e-06)
    """

    def __init__(self, stabilizer: float = 1e-6) -> None:
        self.stabilizer = float(stabilizer)

    def prepare(self, layer: Layer, x: torch.Tensor, z: torch.Tensor) -> Step:
        """See the class documentation."""
        ones = layer.derived("ones", lambda: torch.ones_like(layer.weight))
        den = stabilize(layer.forward(torch.ones_like(x), ones, _zero_like(layer.bias)), self.stabilizer)
        return lambda r, x: layer.adjoint(r / den, ones, x)


# -- shared terms -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Split:
    """``x+`` and ``x-``, with ``x-`` ``None`` when ``x`` has no negative entry (after a ReLU): its terms are 0.

    ``x+`` is then ``x`` itself, and the terms of ``x-``, exactly 0, are skipped.
    """

    pos: torch.Tensor
    neg: torch.Tensor | None

    @classmethod
    def of(cls, x: torch.Tensor) -> _Split:
        if not bool(x.min() < 0):  # one reduction, no boolean tensor
            return cls(x, None)
        return cls(positive(x), negative(x))


def _parts(layer: Layer, x: _Split, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``z+ = f(x+; W+, b+) + f(x-; W-, 0) >= 0`` and ``z- = f(x+; W-, b-) + f(x-; W+, 0) <= 0``, fresh tensors.

    The two add up to the layer's output ``z``, so ``z-`` is taken as ``min(z - z+, 0)``: one convolution after a
    ReLU (``x- = 0``), two otherwise, for the four of the formula.
    """
    z_pos = _two_sided(layer, x, (_weight(layer, "+"), _clamped(layer.bias, 1)), partial(_weight, layer, "-"))
    return z_pos, torch.sub(z, z_pos).clamp_(max=0.0)


def _paired_step(
    layer: Layer,
    x: _Split,
    first: tuple[torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor],
) -> Step:
    """``R_in = x+ * (f^T(R a; W1) + f^T(R b; W2)) + x- * (f^T(R a; W2) + f^T(R b; W1))``.

    ``first = (a, W1)`` and ``second = (b, W2)`` are the scales of the relevance ``R`` at the output and the weights
    they go back through.
    """
    (a, w1), (b, w2) = first, second

    def spread(s1: torch.Tensor, s2: torch.Tensor, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        return layer.adjoint(s1, v1, x.pos).add_(layer.adjoint(s2, v2, x.pos))

    def step(r: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        s1, s2 = r * a, r * b
        out = x.pos * spread(s1, s2, w1, w2)
        return out if x.neg is None else out.add_(x.neg * spread(s1, s2, w2, w1))

    return step


def _two_sided(
    layer: Layer,
    x: _Split,
    pos: tuple[torch.Tensor, torch.Tensor | None],
    neg: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """``f(x+; *pos) + f(x-; neg(), 0)``, the second term left out when ``x`` has no negative entry."""
    out = layer.forward(x.pos, *pos)
    if x.neg is None:
        return out
    return out + layer.forward(x.neg, neg(), None)


def _spread(
    layer: Layer, x: _Split, s: torch.Tensor, w_pos: torch.Tensor, w_neg: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``x+ * f^T(s; w_pos) + x- * f^T(s; w_neg())``, without the second term when ``x`` has no negative entry."""
    out = x.pos * layer.adjoint(s, w_pos, x.pos)
    if x.neg is None:
        return out
    return out + x.neg * layer.adjoint(s, w_neg(), x.pos)


def _bound(value: float | torch.Tensor, x: torch.Tensor, what: str) -> torch.Tensor:
    """``low``/``high`` broadcast to the input's shape, as a tensor of its dtype and device."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    try:
        return bound.expand_as(x) if bound.dim() <= x.dim() else bound[: x.shape[0]].expand_as(x)
    except RuntimeError:
        raise ValueError(
            f"ZBox `{what}` of shape {tuple(bound.shape)} does not broadcast to the first layer's input of shape "
            f"{tuple(x.shape)}: pass a number or a tensor such as (1, C, 1, 1)"
        ) from None
