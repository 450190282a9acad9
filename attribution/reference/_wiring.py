"""Which rule each module of a model gets, and the hooks that apply them during one DeepLIFT forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._run import SiteValueError
from .._transformer_rules import Replace
from ..models import MLPLayout, gated_mlps, is_rms_norm
from . import _math
from ._functions import Product
from .rules import FrozenScale, MaxPoolRule, Rescale, Rule, SoftmaxRule

ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.SiLU,
    nn.GELU,
    nn.Mish,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.LogSigmoid,
    nn.Softsign,
    nn.Softshrink,
    nn.Hardshrink,
    nn.Tanhshrink,
    nn.Threshold,
)
"""Elementwise activations of torch: the Rescale rule."""
ACTIVATION_MODULES = ("transformers.activations", "timm.layers.activations")
"""Where HuggingFace and timm define their activation modules (GELU variants, SiLU, ...), elementwise all."""
MAX_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
UNSUPPORTED = (
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.FractionalMaxPool2d,
    nn.FractionalMaxPool3d,
    nn.LPPool1d,
    nn.LPPool2d,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LocalResponseNorm,
    nn.Softmin,
    nn.LogSoftmax,
    nn.Softmax2d,
    nn.GLU,
)
"""Nonlinear modules no rule covers: their gradient would pass for a multiplier, so the call refuses them."""


@dataclass(frozen=True)
class Plan:
    """The rule of every module that gets one, by name, and the gated MLPs whose product gets the average rule."""

    rules: dict[str, Rule]
    products: tuple[MLPLayout, ...]


def plan(model: nn.Module, eps: float) -> Plan:
    """The rules and products of ``model``; raises on the nonlinear modules no rule covers."""
    rescale, pool, softmax, norm = Rescale(eps), MaxPoolRule(eps), SoftmaxRule(eps), FrozenScale(eps)
    rules: dict[str, Rule] = {}
    refused = []
    for name, module in model.named_modules():
        kind = type(module)
        if isinstance(module, ELEMENTWISE) or kind.__module__.startswith(ACTIVATION_MODULES):
            rules[name] = rescale
        elif isinstance(module, MAX_POOLS):
            if module.return_indices:
                refused.append(f"{name!r} (MaxPool with return_indices=True)")
            rules[name] = pool
        elif isinstance(module, nn.Softmax):
            rules[name] = softmax
        elif isinstance(module, nn.LayerNorm) or is_rms_norm(module):
            rules[name] = norm
        elif isinstance(module, UNSUPPORTED):
            refused.append(f"{name!r} ({kind.__name__})")
    products = gated_mlps(model)
    for mlp in products:
        if mlp.act is None or mlp.act not in rules:
            what = "no activation module" if mlp.act is None else f"activation {mlp.act!r} without a rule"
            refused.append(f"{mlp.module!r} (a gated MLP, act(gate_proj(x)) * up_proj(x), with {what})")
    if refused:
        raise ValueError(
            f"DeepLift has no rule for module(s) {', '.join(refused[:6])}"
            + (f" and {len(refused) - 6} more" if len(refused) > 6 else "")
            + ": their gradient is not a DeepLIFT multiplier. It handles elementwise activations (torch, timm and "
            "HuggingFace activation modules), nn.MaxPool1d/2d/3d, nn.Softmax, nn.LayerNorm, RMSNorms and gated MLPs "
            "whose activation is a module; use "
            "attribution.GradientShap or IntegratedGradients for this model"
        )
    return Plan(rules, products)


class Wiring:
    """The hooks of one DeepLIFT call: the rules on their modules, for a batch of ``batch`` inputs + references."""

    def __init__(self, group: HookGroup, planned: Plan, batch: int) -> None:
        self.rules = planned.rules
        self.batch = batch
        self.pending: dict[str, list[tuple[torch.Tensor, bool]]] = {}  # module -> (input, grad mode) of open calls
        self.factors: dict[str, torch.Tensor] = {}  # a gated MLP's act and up outputs of its current call, by name
        self.kept = {name for mlp in planned.products for name in (mlp.act, mlp.up)}
        self.products = {mlp.down: mlp for mlp in planned.products}
        if self.rules:
            group.forward_pre(list(self.rules), self._before)
            group.forward(list(self.rules), self._after)
        if self.products:
            group.forward([mlp.up for mlp in planned.products], self._keep)
            group.forward_pre(list(self.products), self._product)

    def _before(self, module: nn.Module, args: tuple[Any, ...], *, name: str) -> Any:
        """Keep the input and the grad mode; run the module without autograd (a rule hands its output on)."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != 2 * self.batch:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SiteValueError(
                f"DeepLift runs inputs and references as one batch of {2 * self.batch} and pairs them along the first "
                f"axis, but module {name!r} was called with {got}: its input is not batch-first. DeepLift needs "
                "batch-first activations"
            )
        self.pending.setdefault(name, []).append((x, torch.is_grad_enabled()))
        torch.set_grad_enabled(False)
        if getattr(module, "inplace", False) is True:  # the kept input must survive an in-place activation
            return (x.clone(), *args[1:])
        return None

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str) -> Any:
        x, grad_mode = self.pending[name].pop()
        torch.set_grad_enabled(grad_mode)
        if not isinstance(output, torch.Tensor) or output.shape[0] != x.shape[0]:
            raise SiteValueError(f"module {name!r} returned {type(output).__name__}; DeepLift's rules need a tensor")
        step = self.rules[name].prepare(module, x.detach(), output.detach(), self.batch)
        replaced = Replace.apply(x, [output.detach(), step])
        if name in self.kept:
            self.factors[name] = replaced
        return replaced

    def _keep(self, module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str) -> None:
        self.factors[name] = output

    def _product(self, module: nn.Module, args: tuple[Any, ...], *, name: str) -> Any:
        """Hand the down projection ``act * up`` through :class:`Product`, whose backward is the average rule."""
        mlp, h = self.products[name], args[0]
        a, b = self.factors.pop(str(mlp.act), None), self.factors.pop(mlp.up, None)
        if a is None or b is None or a.shape != h.shape or b.shape != h.shape or not _is_product(h, a, b):
            raise SiteValueError(
                f"DeepLift reads the gated MLP {mlp.module!r} as down_proj(act(gate_proj(x)) * up_proj(x)), but the "
                f"input of {name!r} is not the product of {mlp.act!r}'s and {mlp.up!r}'s outputs of this call. Use "
                "attribution.GradientShap or IntegratedGradients for this model"
            )
        m_a, m_b = _math.average_rule(a[: self.batch], a[self.batch :], b[: self.batch], b[self.batch :])
        m_a, m_b = torch.cat([m_a, m_a]).detach(), torch.cat([m_b, m_b]).detach()
        return (Product.apply(a, b, [h.detach(), lambda g: (g * m_a, g * m_b)]), *args[1:])


def _is_product(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``h`` is ``a * b`` up to the rounding of one multiplication."""
    product = (a * b).detach()
    return bool(torch.allclose(h.detach(), product, rtol=1e-3, atol=1e-6 * float(product.abs().max().clamp_min(1))))
