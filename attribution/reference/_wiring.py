"""Which rule each module of a model gets, and the hooks that apply them during one DeepLIFT forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._run import SiteValueError
from .._transformer_rules import Replace
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
GATED = ("gate_proj", "up_proj", "down_proj")


def _is_rms_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm) or (
        type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


def plan(model: nn.Module, eps: float) -> dict[str, Rule]:
    """The rule of every module that gets one, by name; raises on the nonlinear modules no rule covers."""
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
        elif isinstance(module, nn.LayerNorm) or _is_rms_norm(module):
            rules[name] = norm
        elif isinstance(module, UNSUPPORTED):
            refused.append(f"{name!r} ({kind.__name__})")
        elif all(isinstance(getattr(module, part, None), nn.Module) for part in GATED):
            refused.append(f"{name!r} ({kind.__name__}: a gated MLP, act(gate_proj(x)) * up_proj(x))")
    if refused:
        raise ValueError(
            f"DeepLift has no rule for module(s) {', '.join(refused[:6])}"
            + (f" and {len(refused) - 6} more" if len(refused) > 6 else "")
            + ": their gradient is not a DeepLIFT multiplier. It handles elementwise activations (torch, timm and "
            "HuggingFace activation modules), nn.MaxPool1d/2d/3d, nn.Softmax, nn.LayerNorm and RMSNorms; use "
            "attribution.GradientShap or IntegratedGradients for this model"
        )
    return rules


class Wiring:
    """The hooks of one DeepLIFT call: the rules on their modules, for a batch of ``batch`` inputs + references."""

    def __init__(self, group: HookGroup, rules: dict[str, Rule], batch: int) -> None:
        self.rules = rules
        self.batch = batch
        self.pending: dict[str, list[tuple[torch.Tensor, bool]]] = {}  # module -> (input, grad mode) of open calls
        if rules:
            group.forward_pre(list(rules), self._before)
            group.forward(list(rules), self._after)

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
        return Replace.apply(x, [output.detach(), step])
