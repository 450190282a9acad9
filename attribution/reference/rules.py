"""DeepLIFT's rules as small objects, registered by module type on one hook group (the LRP family's mechanism).

DeepLIFT (Shrikumar et al., 2017, https://arxiv.org/abs/1704.02685) runs the inputs and their references as one
batch, inputs first. At each nonlinearity a pre-hook keeps the module's input ``x`` (both halves), the module runs
without autograd, and a forward hook hands its output on through an autograd function (``Replace``),
whose backward is the rule's step. A rule is an object with one method, :meth:`Rule.prepare`, which receives the
module, its input and output (both halves) and the batch size, and returns that step. With ``x``, ``r`` the input
and reference halves and ``y``, ``y_r`` the module's outputs for them:

* :class:`Rescale` (elementwise activations): ``g -> g * (y - y_r) / (x - r)``, the gradient where
  ``|x - r| < eps``;
* :class:`MaxPoolRule` (captum's max-pool rule): ``max(y, y_r) - y_r`` goes back through the input's winners and
  ``y - max(y, y_r)`` through the reference's, both divided by ``x - r``;
* :class:`SoftmaxRule`: the Rescale step, then its mean along the softmax's axis subtracted, per item;
* :class:`FrozenScale` (LayerNorm, RMSNorm): the norm's gradient with its normalising scale held constant.

Linear modules (convolutions, linear layers, batch norms in eval mode, average pools, sums) keep their gradient,
which is already their multiplier. Every step is exact for the input half; the reference half's gradient is not
used.

Example:
    >>> import torch
    >>> x = torch.tensor([[2.0, -1.0], [0.0, 1.0]])       # the input (2, -1) and its reference (0, 1)
    >>> step = Rescale().prepare(torch.nn.ReLU(), x, torch.relu(x), batch=1)
    >>> step(torch.ones(2, 2))[:1]                          # (2 - 0) / (2 - 0) and (0 - 1) / (-1 - 1)
    tensor([[1.0000, 0.5000]])
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import norm_eps, weight
from . import _math
from ._functions import Step, module_vjp

__all__ = ["FrozenScale", "MaxPoolRule", "Rescale", "Rule", "SoftmaxRule"]


class Rule:
    """Base class of the rules: :meth:`prepare` runs in the forward pass and returns the backward step."""

    def __init__(self, eps: float = _math.EPS) -> None:
        self.eps = float(eps)

    def prepare(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Step:
        """The step ``g -> gradient at x`` of one call of ``module``.

        Args:
            module: the module.
            x: its input, ``(2 * batch, ...)``: the inputs' half, then the references'.
            y: its output for ``x``, likewise.
            batch: the number of items in each half.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eps={self.eps:g})"


class Rescale(Rule):
    """The Rescale rule for elementwise activations: the multiplier ``(y - y_r) / (x - r)``.

    Where ``|x - r| < eps`` the module's own gradient is used (recomputed for those entries only), as captum does.

    Example:
        >>> Rescale()
        Rescale(eps=1e-10)
    """

    def prepare(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Step:
        """See the class documentation."""
        m = _math.rescale(x[:batch], x[batch:], y[:batch], y[batch:], self.eps)
        both = torch.cat([m, m])
        near = _math.fallback(x[:batch], x[batch:], self.eps)
        if not bool(near.any()):
            return lambda g: g * both
        near_both = torch.cat([near, near])
        return lambda g: g * both + module_vjp(module, x, g * near_both)


class MaxPoolRule(Rule):
    """captum's DeepLIFT rule for max pooling (``nn.MaxPool1d/2d/3d``).

    ``max(y, y_r) - y_r`` is routed to the input's winners and ``y - max(y, y_r)`` to the reference's (overlapping
    windows add up, as the max pool's gradient does), and their sum divided by ``x - r``; the gradient where
    ``|x - r| < eps``.

    Example:
        >>> MaxPoolRule()
        MaxPoolRule(eps=1e-10)
    """

    def prepare(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Step:
        """See the class documentation."""
        up, down = _math.cross_max_shares(y[:batch], y[batch:])
        dx = x[:batch] - x[batch:]
        near = _math.fallback(x[:batch], x[batch:], self.eps)

        def step(g: torch.Tensor) -> torch.Tensor:
            gx = g[:batch]
            spread = module_vjp(module, x, torch.cat([gx * up, gx * down]))
            out = torch.where(near, 0.0, (spread[:batch] + spread[batch:]) / torch.where(near, 1.0, dx))
            if bool(near.any()):
                plain = module_vjp(module, x, torch.cat([gx, torch.zeros_like(gx)]))[:batch]
                out = torch.where(near, plain, out)
            return torch.cat([out, torch.zeros_like(out)])

        return step


class SoftmaxRule(Rule):
    """``nn.Softmax``: the Rescale step, then its mean along the softmax's axis subtracted, per item.

    captum subtracts one mean over the whole batch (inputs and references together) instead, so its result for one
    item depends on the others; here each item and position is normalised on its own.

    Example:
        >>> SoftmaxRule()
        SoftmaxRule(eps=1e-10)
    """

    def prepare(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Step:
        """See the class documentation."""
        dim = getattr(module, "dim", None)
        if dim is None:
            raise ValueError("DeepLift's softmax rule needs nn.Softmax(dim=...) with an explicit `dim`; got dim=None")
        rescaled = Rescale(self.eps).prepare(module, x, y, batch)
        return lambda g: _math.centred(rescaled(g), dim)


class FrozenScale(Rule):
    """LayerNorm and RMSNorm with the normalising scale held constant: the norm is then linear in its input.

    ``nn.LayerNorm``: ``g -> (g w - mean(g w)) / sqrt(var(x) + eps)``; an RMSNorm (``nn.RMSNorm`` or any module whose
    output is ``gain * x / sqrt(mean(x^2) + eps)``, HuggingFace's included, gain ``w`` or ``1 + w``):
    ``g -> g * gain / sqrt(mean(x^2) + eps)``, the gain read from the module's output for an input of ones. Each half
    uses its own scale, so the attributions no longer sum exactly to the output difference; ``return_delta`` says
    by how much.

    Example:
        >>> norm, x = torch.nn.RMSNorm(2, eps=0.0), torch.tensor([[3.0, 4.0], [0.0, 1.0]])
        >>> FrozenScale().prepare(norm, x, norm(x).detach(), batch=1)(torch.ones(2, 2))[0]   # 1 / rms = 1 / sqrt(12.5)
        tensor([0.2828, 0.2828])
    """

    def prepare(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Step:
        """See the class documentation."""
        w = weight(module, device=x.device)  # real also where accelerate offloaded the norm
        if isinstance(module, nn.LayerNorm):
            dims = tuple(range(-len(module.normalized_shape), 0))
            std = (x.var(dim=dims, unbiased=False, keepdim=True) + module.eps).sqrt()

            def layer_norm(g: torch.Tensor) -> torch.Tensor:
                gw = g * w if w is not None else g
                return (gw - gw.mean(dim=dims, keepdim=True)) / std

            return layer_norm
        eps = norm_eps(module, default=float(torch.finfo(x.dtype).eps))  # nn.RMSNorm's eps=None: torch's default
        scale = _rms_gain(module, x, eps) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if not torch.allclose(scale * x, y, rtol=1e-3, atol=1e-5 * float(y.abs().max())):
            raise ValueError(
                f"{type(module).__name__} is not an RMSNorm this rule knows (gain * x / sqrt(mean(x^2) + eps) over the "
                "last axis): DeepLift cannot hold its scale constant. Give the model a norm it knows (nn.LayerNorm, "
                "nn.RMSNorm)"
            )
        return lambda g: g * scale


def _rms_gain(module: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel gain of an RMSNorm, from its output for ones: ``gain / sqrt(1 + eps)``."""
    with torch.no_grad():
        ones = torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device)
        return module.forward(ones).reshape(-1).to(x.dtype) * (1 + eps) ** 0.5
