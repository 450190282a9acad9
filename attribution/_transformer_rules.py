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

from .models import LMLayout, lm_layout, norm_eps, rms_norm_gain, weight

__all__ = [
    "Replace",
    "Scale",
    "Sites",
    "identity_rule",
    "layer_norm_rule",
    "norm_rule",
    "register_rules",
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
    gain = weight(norm, device=x.device)
    if isinstance(norm, nn.LayerNorm):
        return layer_norm_rule(x, gain, float(norm.eps))
    eps = norm_eps(norm)
    if gain is None:
        raise TypeError(f"the LN-rule needs an nn.LayerNorm or an RMSNorm with a `weight`; got {type(norm).__name__}")
    return rms_norm_rule(x, rms_norm_gain(norm, gain, eps), eps)


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


def sites(model: nn.Module, layout: LMLayout | None = None) -> Sites:
    """Where the rules go in a decoder LM, from its :func:`attribution.models.lm_layout`; raises for a part it lacks.

    Per layer: the query/key/value projections (separate, or fused in blocks or per head) get their output's gradient
    scaled 0.25/0.25/0.5; a gated MLP's down projection half its input's gradient; the MLP's activation module the
    identity rule. Every LayerNorm and RMSNorm of the model gets the norm rule.
    """
    if layout is None and not callable(getattr(model, "get_input_embeddings", None)):
        raise TypeError(
            f"the rules need a HuggingFace language model with get_input_embeddings(); got {type(model).__name__}"
        )
    layout = layout or lm_layout(model)
    found = Sites(layout.embed, {}, [], [], [], [])
    for layer in layout.layers:
        attention, mlp = layer.attention, layer.mlp_parts
        if attention.qkv_order == "per_head":
            raise ValueError(
                f"{attention.qkv!r} fuses query, key and value per head (GPT-NeoX): the rules are known on separate "
                "q/k/v projections and on projections fused in blocks (GPT-2's c_attn) only"
            )
        if attention.qkv is not None:
            found.scaled[attention.qkv] = _fused_factors(layout)
        else:
            found.scaled.update({str(attention.q): 0.25, str(attention.k): 0.25, str(attention.v): 0.5})
        if mlp is None or mlp.act is None:
            raise ValueError(
                f"found no MLP activation module in {layer.mlp!r} (looked for gate/up/down projections or fc/proj "
                "with an activation module: act_fn, act, activation_fn): the identity rule needs it as a module; pass "
                "`children={'act': '<name inside the MLP>'}` to attribution.models.lm_layout"
            )
        if mlp.kind == "gated":
            found.halved_inputs.append(mlp.down)
        found.activations.append(mlp.act)
    for name, kind in layout.norms:
        (found.rms_norms if kind == "rms" else found.layer_norms).append(name)
    return found


def _fused_factors(layout: LMLayout) -> torch.Tensor:
    """The per-feature factors of a q|k|v projection fused in blocks (GPT-2): 0.25 on q and k, 0.5 on v."""
    d = layout.head_dim
    return torch.tensor([0.25] * (layout.n_heads + layout.n_kv_heads) * d + [0.5] * layout.n_kv_heads * d)


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
