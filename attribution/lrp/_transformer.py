"""AttnLRP's rules for transformers as hooks: where they go in a model (:func:`sites`) and how (:func:`register_rules`).

The rules (Achtibat et al. 2024, https://arxiv.org/abs/2402.05602) in their gradient form, each a forward hook that
keeps the module's output value and changes only the gradient flowing back through it:

* softmax: its own gradient (AttnLRP's softmax rule is gradient times input);
* the bilinear products: the uniform rule, half of the relevance to each factor. For ``softmax(q k^T) v`` the
  gradient into ``v`` is halved and the gradients into ``q`` and ``k`` quartered (half at ``A v``, half again at
  ``q k^T``); for the gated MLP ``act(gate) * up`` the gradient into the product is halved;
* elementwise nonlinearities (the MLP's activation): the identity rule, gradient ``act(x) / x``;
* RMSNorm and LayerNorm: the normalising scale ``1 / rms`` (``1 / std``) is a constant (no gradient through it);
* linear layers: their gradient (LRP-0, i.e. epsilon rule with epsilon 0, in gradient-times-input form).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

__all__ = [
    "Replace",
    "Scale",
    "Sites",
    "identity_rule",
    "layer_norm_rule",
    "norm_rule",
    "register_rules",
    "rms_norm_gain",
    "rms_norm_rule",
    "scaled_attention_inputs",
    "sites",
]

IDENTITY_EPSILON = 1e-10
"""Added to the input of an activation in the identity rule's ``act(x) / (x + eps)`` (as LXT)."""


class Scale(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``factor`` (a number or a broadcastable tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: Any) -> torch.Tensor:
        """Return ``x`` (as a view)."""
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``grad * factor``."""
        return grad * ctx.factor, None


class Replace(torch.autograd.Function):
    """``x -> output`` (computed by the module) whose backward is ``backward(grad)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[Any]) -> torch.Tensor:
        """Return ``box[0]``; keep the backward ``box[1]``."""
        ctx.backward_fn = box[1]
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The rule's backward."""
        return ctx.backward_fn(grad), None


# -- the rules as pure functions of the forward's tensors ------------------------------------------------------------
def identity_rule(x: torch.Tensor, y: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """AttnLRP's identity rule for ``y = act(x)`` elementwise: the backward ``g -> g * y / (x + 1e-10)``.

    Example:
        >>> x = torch.tensor([1.0, -2.0]); y = torch.nn.functional.silu(x)
        >>> identity_rule(x, y)(torch.ones(2)) * x     # relevance in = relevance out (gradient times input)
        tensor([ 0.7311, -0.2384])
    """
    ratio = y / (x + IDENTITY_EPSILON)
    return lambda g: ratio * g


def rms_norm_rule(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The backward of HuggingFace's RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))`` with the scale held constant.

    Computed in float32 as the forward is (Llama, Qwen2, Mistral).

    Example:
        >>> x = torch.tensor([[3.0, 4.0]])
        >>> rms_norm_rule(x, torch.ones(2), 0.0)(torch.ones(1, 2))     # 1 / rms(x) = 1 / sqrt(12.5)
        tensor([[0.2828, 0.2828]])
    """
    scale = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    return lambda g: ((weight * g).to(torch.float32) * scale).to(x.dtype)


def layer_norm_rule(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The backward of ``(x - mean(x)) / std(x) * w + b`` with ``std`` held constant (the mean is not).

    Example:
        >>> g = layer_norm_rule(torch.tensor([[1.0, 3.0]]), None, 0.0)(torch.tensor([[1.0, 0.0]]))
        >>> g                                           # (g - mean(g)) / std, std = 1
        tensor([[ 0.5000, -0.5000]])
    """
    std = (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()

    def backward(g: torch.Tensor) -> torch.Tensor:
        gw = g * weight if weight is not None else g
        return (gw - gw.mean(-1, keepdim=True)) / std

    return backward


def norm_rule(norm: nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LN-rule backward of ``norm`` (an ``nn.LayerNorm`` or an RMSNorm with ``weight``) at its input ``x``.

    Example:
        >>> norm_rule(torch.nn.LayerNorm(2), torch.tensor([[1.0, 3.0]]))(torch.tensor([[1.0, 0.0]]))
        tensor([[ 0.5000, -0.5000]])
    """
    weight = getattr(norm, "weight", None)
    weight = weight.detach() if isinstance(weight, torch.Tensor) else None
    if isinstance(norm, nn.LayerNorm):
        return layer_norm_rule(x, weight, float(norm.eps))
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if weight is None:
        raise TypeError(f"the LN-rule needs an nn.LayerNorm or an RMSNorm with a `weight`; got {type(norm).__name__}")
    return rms_norm_rule(x, rms_norm_gain(norm, weight, eps), eps)


def rms_norm_gain(norm: nn.Module, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel gain an RMSNorm multiplies by: ``weight`` (Llama, Qwen2, Mistral) or ``1 + weight`` (Gemma).

    Read from the module itself: its output for an input of ones is ``gain / sqrt(1 + eps)``.

    Raises:
        ValueError: the output fits neither convention (a norm this rule does not know).

    Example:
        >>> class OffsetRMSNorm(torch.nn.Module):      # Gemma's convention
        ...     def __init__(self):
        ...         super().__init__(); self.weight, self.eps = torch.nn.Parameter(torch.zeros(2)), 1e-6
        ...     def forward(self, x):
        ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)
        >>> rms_norm_gain(OffsetRMSNorm(), torch.zeros(2), 1e-6)
        tensor([1., 1.])
    """
    with torch.no_grad():
        ones = torch.ones(1, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        probe = norm.forward(ones).reshape(-1).to(weight.dtype) * (1 + eps) ** 0.5
    gain = min((weight, 1 + weight), key=lambda g: float((probe - g).abs().max()))  # the closer convention
    if torch.allclose(probe, gain, rtol=1e-3, atol=1e-5):
        return gain
    raise ValueError(
        f"{type(norm).__name__} multiplies by neither its `weight` nor `1 + weight` (its output for ones is "
        f"{probe[:3].tolist()}..., its weight {weight[:3].tolist()}...): the norm rule does not know this RMSNorm"
    )


# -- which modules get which rule ----------------------------------------------------------------------------------
@dataclass
class Sites:
    """Module names of one model, by rule."""

    embedding: str
    scaled: dict[str, float | torch.Tensor]  # module -> factor on the gradient of its output
    halved_inputs: list[str]  # modules whose input (a gated product) gets half the gradient
    activations: list[str]
    rms_norms: list[str]
    layer_norms: list[str]
    attention_inputs: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """``nn.MultiheadAttention`` modules -> factors on the gradients of their query, key and value inputs."""
    tokens: str | None = None
    """ViTs: the module whose first input is the token sequence (class token and position embedding added)."""


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def sites(model: nn.Module) -> Sites:
    """Where the rules go in a HuggingFace decoder LM (Llama/Qwen2/Mistral style, or GPT-2); raises otherwise."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    names = {id(m): n for n, m in model.named_modules()}
    if not isinstance(embeddings, nn.Module) or id(embeddings) not in names:
        raise TypeError(
            f"AttnLRP needs a HuggingFace language model with get_input_embeddings(); got {type(model).__name__}"
        )
    found = Sites(names[id(embeddings)], {}, [], [], [], [])
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if all(isinstance(getattr(module, p, None), nn.Module) for p in ("q_proj", "k_proj", "v_proj")):
            found.scaled.update({prefix + "q_proj": 0.25, prefix + "k_proj": 0.25, prefix + "v_proj": 0.5})
        elif isinstance(getattr(module, "c_attn", None), nn.Module) and hasattr(module, "split_size"):
            if getattr(module, "is_cross_attention", False):
                continue
            split = int(module.split_size)
            found.scaled[prefix + "c_attn"] = torch.tensor([0.25] * split + [0.25] * split + [0.5] * split)
        if all(isinstance(getattr(module, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj")):
            found.halved_inputs.append(prefix + "down_proj")
            found.activations.append(prefix + "act_fn")
        elif isinstance(getattr(module, "c_fc", None), nn.Module) and isinstance(
            getattr(module, "act", None), nn.Module
        ):
            found.activations.append(prefix + "act")
        if _is_rms_norm(module):
            found.rms_norms.append(name)
        elif isinstance(module, nn.LayerNorm):
            found.layer_norms.append(name)
    if not found.scaled:
        raise ValueError(
            f"AttnLRP found no attention it knows in {type(model).__name__}: it handles HuggingFace decoders whose "
            "attention has q_proj, k_proj and v_proj (Llama, Qwen2, Mistral, ...) or GPT-2's c_attn"
        )
    missing = [n for n in found.activations if not isinstance(model.get_submodule(n), nn.Module)]
    if missing:
        raise ValueError(f"AttnLRP needs the MLP activations as modules; {missing} are not")
    return found


def register_rules(group: HookGroup, where: Sites) -> None:
    """Put AttnLRP's rules (everything but the input leaf) on ``group``, as forward hooks on ``where``'s modules.

    Shared by :class:`attribution.AttnLRP` and anything else that wants the LRP-modified backward of a transformer
    (RelP, Jafari et al. 2025): the forward values are unchanged, only the gradients flowing back are the rules'.
    """

    def scale(module: nn.Module, args: Any, output: torch.Tensor, *, name: str) -> torch.Tensor:
        factor = where.scaled[name]
        if isinstance(factor, torch.Tensor):
            factor = factor.to(output.dtype)
        return Scale.apply(output, factor)

    def split_attention(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return scaled_attention_inputs(args, kwargs, where.attention_inputs[name])

    def halve_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (Scale.apply(args[0], 0.5), *args[1:])

    def identity(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return Replace.apply(args[0], [output.detach(), identity_rule(args[0].detach(), output.detach())])

    def norm(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return Replace.apply(args[0], [output.detach(), norm_rule(module, args[0].detach())])

    if where.scaled:
        group.forward(list(where.scaled), scale)
    if where.attention_inputs:
        group.forward_pre(list(where.attention_inputs), split_attention, with_kwargs=True)
    if where.halved_inputs:
        group.forward_pre(where.halved_inputs, halve_input)
    if where.activations:
        group.forward(where.activations, identity)
    if where.rms_norms or where.layer_norms:
        group.forward(where.rms_norms + where.layer_norms, norm)


def scaled_attention_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], factors: tuple[float, float, float]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``nn.MultiheadAttention``'s ``query``, ``key``, ``value`` as three views whose gradients are scaled apart.

    Three distinct tensors make the attention project them separately (``in_proj_weight`` in three chunks, no fused
    fast path): the output equals the fused self-attention's up to rounding (``allclose``, not always bitwise).

    Example:
        >>> x = torch.ones(1, 2, 4, requires_grad=True)
        >>> args, _ = scaled_attention_inputs((x, x, x), {}, (0.25, 0.25, 0.5))
        >>> torch.autograd.grad(sum(a.sum() for a in args), x)[0][0, 0]
        tensor([1., 1., 1., 1.])
    """
    keys = ("query", "key", "value")
    args, kwargs = tuple(args), dict(kwargs)
    values = [args[i] if i < len(args) else kwargs.pop(keys[i]) for i in range(3)]
    scaled = tuple(Scale.apply(v, f) for v, f in zip(values, factors, strict=True))
    return (*scaled, *args[3:]), kwargs
