"""AttnLRP for HuggingFace decoder language models (Achtibat et al. 2024), through hooks on modules.

AttnLRP (https://arxiv.org/abs/2402.05602) in its gradient-times-input form (LXT's "efficient" implementation):
the relevance of a token is ``sum_d e_td * g_td`` at the embedding output ``e``, with ``g`` the gradient of the
target logit modified by the paper's rules:

* softmax: its own gradient (AttnLRP's softmax rule is gradient times input);
* the bilinear products: the uniform rule, half of the relevance to each factor. For ``softmax(q k^T) v`` the
  gradient into ``v`` is halved and the gradients into ``q`` and ``k`` quartered (half at ``A v``, half again at
  ``q k^T``); for the gated MLP ``act(gate) * up`` the gradient into the product is halved;
* elementwise nonlinearities (the MLP's activation): the identity rule, gradient ``act(x) / x``;
* RMSNorm and LayerNorm: the normalising scale ``1 / rms`` (``1 / std``) is a constant (no gradient through it);
* linear layers: their gradient (LRP-0, i.e. epsilon rule with epsilon 0, in gradient-times-input form).

Each rule is a hook of one :class:`hooks.HookGroup` on the module it concerns (``q_proj``/``k_proj``/``v_proj``
or GPT-2's ``c_attn``, the MLP's ``act_fn`` and ``down_proj``, the norms, the input embedding); nothing of the model
is replaced or patched, and the hooks are removed after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._run import HookedRun, no_dependence, warn

__all__ = ["AttnLRP", "TokenRelevance"]

TokenTarget = int | list[int] | torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None
IDENTITY_EPSILON = 1e-10
"""Added to the input of an activation in the identity rule's ``act(x) / (x + eps)`` (as LXT)."""


@dataclass
class TokenRelevance:
    """The result of :meth:`attribution.AttnLRP.attribute`.

    Attributes:
        relevance: ``(batch, tokens)``, or ``(batch, tokens, hidden)`` with ``reduce=False``.
        logits: ``(batch,)``: the explained logit of each item.
        targets: ``(batch,)``: the explained token id of each item (``-1`` for a callable target).
    """

    relevance: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor

    @property
    def conservation(self) -> torch.Tensor:
        """``(batch,)``: the summed relevance over the explained logit (1 when nothing is absorbed by biases)."""
        total = self.relevance.flatten(1).sum(1)
        return total / self.logits


class _Scale(torch.autograd.Function):
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


class _Replace(torch.autograd.Function):
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


# -- which modules get which rule ----------------------------------------------------------------------------------
@dataclass
class _Sites:
    """Module names of one model, by rule."""

    embedding: str
    scaled: dict[str, float | torch.Tensor]  # module -> factor on the gradient of its output
    halved_inputs: list[str]  # modules whose input (a gated product) gets half the gradient
    activations: list[str]
    rms_norms: list[str]
    layer_norms: list[str]


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def sites(model: nn.Module) -> _Sites:
    """Where the rules go in a HuggingFace decoder LM (Llama/Qwen2/Mistral style, or GPT-2); raises otherwise."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    names = {id(m): n for n, m in model.named_modules()}
    if not isinstance(embeddings, nn.Module) or id(embeddings) not in names:
        raise TypeError(
            f"AttnLRP needs a HuggingFace language model with get_input_embeddings(); got {type(model).__name__}"
        )
    found = _Sites(names[id(embeddings)], {}, [], [], [], [])
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


# -- the method ----------------------------------------------------------------------------------------------------
class AttnLRP:
    """AttnLRP (Achtibat et al. 2024, https://arxiv.org/abs/2402.05602): relevance of each input token for a logit.

    The same numbers as LXT 2.1's ``monkey_patch`` + gradient times input, for Llama, Qwen2, Mistral and GPT-2
    models of HuggingFace transformers, with the rules applied by hooks (see the module documentation).

    Args:
        model: a HuggingFace causal LM (``...ForCausalLM`` or ``GPT2LMHeadModel``); it is not modified.

    Example:
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> relevance = AttnLRP(model)(torch.tensor([[3, 14, 15, 9, 2]]), target=7)
        >>> relevance.shape
        torch.Size([1, 5])
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = model
        self.sites = sites(model)

    def __call__(
        self, input_ids: Any, target: TokenTarget = None, position: int = -1, reduce: bool = True
    ) -> torch.Tensor:
        """The relevance of each input token for ``target``'s logit at ``position``: ``(batch, tokens)``.

        Args:
            input_ids: ``(batch, tokens)`` token ids, or a mapping of model inputs (a tokenizer's ``BatchEncoding``
                with ``input_ids`` and ``attention_mask``).
            target: ``None`` (the predicted token), a token id, one id per item, or a callable
                ``logits (batch, vocab) -> (batch,)`` scores.
            position: the position whose logits are explained (default the last).
            reduce: sum over the hidden size (``False``: ``(batch, tokens, hidden)``).
        """
        return self.attribute(input_ids, target, position, reduce).relevance

    def attribute(
        self, input_ids: Any, target: TokenTarget = None, position: int = -1, reduce: bool = True
    ) -> TokenRelevance:
        """As calling the object, with the explained logits and the conservation (:class:`TokenRelevance`)."""
        inputs = _as_inputs(input_ids)
        batch, length = inputs["input_ids"].shape
        if not -length <= position < length:
            raise IndexError(f"`position`={position} is out of range for {length} tokens")
        with HookedRun(self.model, "AttnLRP", with_grad=True) as run:
            embedded = _register(run, self.sites)
            output = run.forward(inputs)
            logits = getattr(output, "logits", output)[:, position]
            scores, ids = _scores(logits, target, batch)
            if not embedded or not scores.requires_grad:
                raise no_dependence("the input embedding", self.sites.embedding, scores)
            (grad,) = torch.autograd.grad(scores.sum(), embedded[0])
        relevance = (embedded[0] * grad).detach()
        if reduce:
            relevance = relevance.sum(-1)
        if not bool(torch.isfinite(relevance).all()):
            warn("AttnLRP relevance has NaN or infinite entries: the model overflows in this dtype; try float32/64")
        return TokenRelevance(relevance, scores.detach(), ids)


def _as_inputs(input_ids: Any) -> dict[str, Any]:
    if isinstance(input_ids, Mapping):
        inputs = dict(input_ids)
    else:
        inputs = {"input_ids": input_ids}
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"`input_ids` must be integer token ids (batch, tokens) or a mapping with them; got {got}")
    inputs.setdefault("use_cache", False)
    return inputs


def _scores(logits: torch.Tensor, target: TokenTarget, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The explained logit of each item and its token id (``-1`` for a callable target)."""
    if callable(target):
        scores = target(logits)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (batch,):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"a callable `target` must return scores of shape ({batch},); got {got}")
        return scores, torch.full((batch,), -1, dtype=torch.long)
    if target is None:
        ids = logits.detach().argmax(-1)
    else:
        ids = torch.as_tensor(target, dtype=torch.long, device=logits.device).expand(batch)
        bad = ids[(ids < 0) | (ids >= logits.shape[-1])]
        if bad.numel():
            raise ValueError(f"`target` token {int(bad[0])} is out of range for a vocabulary of {logits.shape[-1]}")
    return logits.gather(1, ids[:, None]).squeeze(1), ids


def _register(run: HookedRun, where: _Sites) -> list[torch.Tensor]:
    """The rules' hooks on ``run.group``; returns the list that will hold the embedding output (the leaf)."""
    embedded: list[torch.Tensor] = []
    group = run.group

    def leaf(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        new = run.leaf(output)
        embedded.append(new)
        return new

    def scale(module: nn.Module, args: Any, output: torch.Tensor, *, name: str) -> torch.Tensor:
        factor = where.scaled[name]
        if isinstance(factor, torch.Tensor):
            factor = factor.to(output.dtype)
        return _Scale.apply(output, factor)

    def halve_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_Scale.apply(args[0], 0.5), *args[1:])

    def identity(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return _Replace.apply(args[0], [output.detach(), identity_rule(args[0].detach(), output.detach())])

    def rms(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        weight = getattr(module, "weight", None)
        assert isinstance(weight, torch.Tensor)
        step = rms_norm_rule(args[0].detach(), weight.detach(), eps)
        return _Replace.apply(args[0], [output.detach(), step])

    def layer_norm(module: nn.LayerNorm, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        weight = module.weight.detach() if module.weight is not None else None
        step = layer_norm_rule(args[0].detach(), weight, float(module.eps))
        return _Replace.apply(args[0], [output.detach(), step])

    group.forward(where.embedding, leaf)
    group.forward(list(where.scaled), scale)
    if where.halved_inputs:
        group.forward_pre(where.halved_inputs, halve_input)
    if where.activations:
        group.forward(where.activations, identity)
    if where.rms_norms:
        group.forward(where.rms_norms, rms)
    if where.layer_norms:
        group.forward(where.layer_norms, layer_norm)
    return embedded
