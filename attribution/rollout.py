"""Attention rollout (Abnar & Zuidema, 2020) and gradient-weighted rollout (Chefer et al., 2021).

The arithmetic is in pure functions of attention maps ``(batch, heads, tokens, tokens)``; the classes find the
attention probabilities in a model, switch on what is needed to see them for one call, and put everything back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import einops
import torch
from torch import nn

from hooks import ModuleTarget, resolve

from . import _cam_math as cm
from ._inputs import batch_size, batched
from ._run import HookedRun, SiteValueError, eager_module, no_dependence
from .targets import Target, check_target, target_scores

Fusion = Literal["mean", "max", "min"]


# -- pure arithmetic -------------------------------------------------------------------------------------------
def fuse_heads(attention: torch.Tensor, fusion: Fusion = "mean") -> torch.Tensor:
    """Fuse the heads of ``(batch, heads, T, T)`` attention into ``(batch, T, T)`` by mean, max or min."""
    if fusion == "mean":
        return attention.mean(dim=1)
    if fusion == "max":
        return attention.amax(dim=1)
    if fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"`head_fusion` must be 'mean', 'max' or 'min'; got {fusion!r}")


def discard_lowest(fused: torch.Tensor, ratio: float) -> torch.Tensor:
    """Zero, per sample, the ``floor(ratio * T * T)`` lowest entries of ``(batch, T, T)``, except in column 0.

    The entries are ranked over the whole ``T x T`` matrix; those of the class token's column (column 0) are kept
    even when they rank among the lowest, so the number actually zeroed can be smaller than ``ratio * T * T``.
    """
    if ratio == 0:
        return fused
    b, t, _ = fused.shape
    count = int(t * t * ratio)
    if count == 0:
        return fused
    flat = fused.reshape(b, t * t)
    kth = flat.kthvalue(count, dim=1, keepdim=True).values  # a selection, much cheaper than topk for large counts
    below, ties = flat < kth, flat == kth
    room = count - below.sum(dim=1, keepdim=True)  # entries equal to the k-th value that still belong to the k lowest
    drop = below | (ties & (ties.cumsum(dim=1) <= room))
    drop &= torch.arange(t * t, device=flat.device) % t != 0  # never the class token's column
    return flat.masked_fill(drop, 0).view(b, t, t)


def attention_rollout(
    attentions: Sequence[torch.Tensor],
    *,
    head_fusion: Fusion = "mean",
    discard_ratio: float = 0.0,
    row: int | None = None,
) -> torch.Tensor:
    """The rollout ``(batch, T, T)`` of per-layer attentions ``(batch, heads, T, T)``, first layer first.

    Per layer: heads fused, the lowest entries discarded (:func:`discard_lowest`), ``A_hat = 0.5 A + 0.5 I`` with
    rows renormalised to sum to 1; then ``R = A_hat_L ... A_hat_2 A_hat_1`` (later layers on the left). Every row
    of ``R`` sums to 1. With ``row=i`` only row ``i`` is computed, ``(batch, T)``, by vector-matrix products (L
    times cheaper than the matrix products).

    Example:
        >>> eye = torch.eye(5).expand(2, 3, 5, 5)   # identity attention: 2 items, 3 heads
        >>> torch.equal(attention_rollout([eye, eye]), torch.eye(5).expand(2, 5, 5))
        True
    """
    _check_options(head_fusion, discard_ratio)
    steps = [_residual_step(discard_lowest(fuse_heads(a, head_fusion), discard_ratio)) for a in attentions]
    if not steps:
        raise ValueError("`attentions` is empty: rollout needs at least one layer")
    return _chain(steps, row)


def _chain(steps: list[torch.Tensor], row: int | None) -> torch.Tensor:
    """``M_L ... M_1`` for per-layer ``(batch, T, T)`` matrices (first layer first), or only its row ``row``."""
    if row is None:
        result = steps[0]
        for step in steps[1:]:
            result = step @ result
        return result
    vector = steps[-1][:, row]  # e_row^T M_L, then times M_(L-1) ... M_1
    for step in reversed(steps[:-1]):
        vector = (vector[:, None] @ step)[:, 0]
    return vector


def _residual_step(fused: torch.Tensor) -> torch.Tensor:
    """``0.5 A + 0.5 I`` with rows renormalised, computed as ``(A + I) / rowsum(A + I)`` (the same matrix)."""
    a_hat = fused.clone()
    a_hat.diagonal(dim1=-2, dim2=-1).add_(1)
    return a_hat.div_(a_hat.sum(dim=-1, keepdim=True))


def gradient_rollout(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], *, row: int | None = None
) -> torch.Tensor:
    """Chefer et al. 2021 (https://arxiv.org/abs/2103.15679), ``(batch, T, T)`` (or its row ``row``, ``(batch, T)``).

    ``A_bar = mean_heads((dS/dA * A)^+)`` per layer; ``R = I``, then ``R = R + A_bar R`` layer by layer, first
    layer first; that is ``R = (I + A_bar_L) ... (I + A_bar_1)``.
    """
    if len(attentions) != len(gradients) or not attentions:
        raise ValueError(
            f"need as many gradients as attentions (at least one); got {len(attentions)} and {len(gradients)}"
        )
    t = attentions[0].shape[-1]
    eye = torch.eye(t, dtype=attentions[0].dtype, device=attentions[0].device)
    steps = [eye + (g * a).clamp(min=0).mean(dim=1) for a, g in zip(attentions, gradients, strict=True)]
    return _chain(steps, row)


def _check_options(head_fusion: str, discard_ratio: float) -> None:
    if head_fusion not in ("mean", "max", "min"):
        raise ValueError(f"`head_fusion` must be 'mean', 'max' or 'min'; got {head_fusion!r}")
    if not isinstance(discard_ratio, (int, float)) or not 0 <= discard_ratio < 1:
        raise ValueError(
            f"`discard_ratio` must be a number in [0, 1) (the share of entries to zero); got {discard_ratio!r}"
        )


# -- finding attention in a model --------------------------------------------------------------------------------
@dataclass
class _Site:
    """Where one layer's attention probabilities appear, and what must be switched on to see them."""

    name: str  # the module whose forward hook sees the probabilities
    kind: Literal["probs", "mha", "hf"]  # output is the probabilities / nn.MultiheadAttention / HF (out, weights)
    switch: nn.Module | None = None  # a timm Attention whose fused path is turned off for the call


def find_attention(model: nn.Module, layers: ModuleTarget | None = None) -> list[_Site]:
    """The attention sites of ``model``, in model order.

    Recognised without help: timm ``Attention`` modules (``fused_attn``, probabilities through ``attn_drop``),
    ``nn.MultiheadAttention`` (torchvision's ViT), and HuggingFace self-attention modules (``config`` with an
    attention implementation; eager attention returns the probabilities). ``layers`` names modules whose output is
    the probabilities ``(batch, heads, T, T)`` (or a tuple holding them), for any other model.
    """
    if layers is not None:
        return [_Site(name, "probs") for name, _ in resolve(model, layers, what="`layers`")]
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            sites.append(_Site(name, "mha"))
        elif hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module):
            sites.append(_Site(f"{name}.attn_drop" if name else "attn_drop", "probs", switch=module))
        elif _is_hf_attention(module) and not any(_is_hf_attention(m) for m in list(module.modules())[1:]):
            sites.append(_Site(name, "hf"))  # the innermost HuggingFace attention module: it returns the weights
    if not sites:
        raise ValueError(
            f"found no attention in {type(model).__name__}: looked for timm Attention modules (fused_attn, attn_drop), "
            "nn.MultiheadAttention and HuggingFace *Attention modules. Pass layers= with the modules whose output "
            "is the attention probabilities (batch, heads, tokens, tokens), e.g. layers='blocks.*.attn.attn_drop'"
        )
    return sites


def _is_hf_attention(module: nn.Module) -> bool:
    """A HuggingFace attention module: an ``...Attention`` class reading ``config._attn_implementation``."""
    return type(module).__name__.endswith("Attention") and hasattr(
        getattr(module, "config", None), "_attn_implementation"
    )


@contextmanager
def _attention_visible(model: nn.Module) -> Iterator[None]:
    """Switch off fused attention (timm) and select eager attention (HuggingFace) for the call; restore after."""
    with ExitStack() as stack:
        for module in model.modules():  # also for sites given by `layers=`: a fused path shows no probabilities
            switch: Any = module
            if getattr(switch, "fused_attn", False) is True:
                stack.callback(setattr, switch, "fused_attn", True)
                switch.fused_attn = False
        configs: dict[int, Any] = {}  # every HuggingFace config in the model, also for sites given by `layers=`
        for module in model.modules():
            config: Any = getattr(module, "config", None)
            if hasattr(config, "_attn_implementation"):
                configs[id(config)] = config
        for config in configs.values():
            stack.callback(_set_attn_implementation, config, config._attn_implementation)
            _set_attn_implementation(config, "eager")
        yield


def _set_attn_implementation(config: Any, value: str | None) -> None:
    try:
        config._attn_implementation = value
    except Exception:  # some versions guard the setter; the internal field is what modules read
        config.__dict__["_attn_implementation_internal"] = value


# -- the public classes ------------------------------------------------------------------------------------------
class _Rollout:
    """Capture the attention maps of one forward, then turn them into relevances."""

    def __init__(self, model: nn.Module, *, layers: ModuleTarget | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = eager_module(model)  # torch.compile(model): its module, run eagerly (hooks need that)
        model = self.model
        self.sites = find_attention(model, layers)
        self.prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))
        if self.prefix_tokens == 0:
            raise ValueError(
                f"{type(model).__name__} has no class token (num_prefix_tokens=0, global average pooling): rollout "
                "reads the class token's row. attention_rollout(maps) on captured maps gives the full (batch, T, T) "
                "rollout to aggregate as you see fit"
            )

    def _capture(
        self, inputs: Any, *, with_grad: bool, target: Target = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """One forward; returns the attention maps (B, H, T, T), the tensors to differentiate, and the output."""
        maps: list[torch.Tensor] = []
        graph: list[torch.Tensor] = []
        asked: list[tuple[bool, bool]] = []  # what each nn.MultiheadAttention call asked for: need, average

        def before_mha(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            kwargs = {**dict(zip(_MHA_ARGUMENTS[3:], args[3:], strict=False)), **kwargs}  # positional options too
            asked.append((bool(kwargs.get("need_weights", True)), bool(kwargs.get("average_attn_weights", True))))
            return args[:3], {**kwargs, "need_weights": True, "average_attn_weights": False}

        def start_graph(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not with_grad or run.started:
                return None
            return run.leaf(args), run.leaf(kwargs)  # the backbone before the first attention keeps no graph

        def after(module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str) -> Any:
            site = next(s for s in self.sites if s.name == name)
            if site.kind == "mha":
                weights = output[1]
                need, average = asked.pop()
                _check_self_attention(weights, name)
                maps.append(weights.detach())
                graph.append(weights._base if weights._base is not None else weights)
                shown = (weights.mean(dim=1) if average else weights) if need else None
                return output[0], shown
            probs = output[1] if site.kind == "hf" else _probabilities(output, name)
            if not isinstance(probs, torch.Tensor) or probs.dim() != 4:
                raise SiteValueError(
                    f"`layers` {name!r} gave {type(probs).__name__} {tuple(getattr(probs, 'shape', ()))}; attention "
                    "probabilities (batch, heads, tokens, tokens) were expected"
                )
            _check_self_attention(probs, name)
            maps.append(probs.detach())
            graph.append(probs)
            return None

        names = [s.name for s in self.sites]
        with HookedRun(self.model, type(self).__name__, with_grad=with_grad) as run, _attention_visible(self.model):
            mha = [s.name for s in self.sites if s.kind == "mha"]
            if mha:
                run.group.forward_pre(mha, before_mha, with_kwargs=True)
            owners = [s.name.rsplit(".", 1)[0] if s.switch is not None else s.name for s in self.sites]
            run.group.forward_pre(owners[0], start_graph, with_kwargs=True)
            run.group.forward(names, after)
            output = run.forward(inputs)
            if not maps:  # a module used several times gives one map per call, chained in call order
                raise ValueError(
                    f"no attention map appeared in the forward ({len(self.sites)} attention module(s) were found but "
                    "none ran); pass layers= naming the modules whose output is the attention probabilities"
                )
            if not with_grad:
                return maps, [], output
            scores = target_scores(output, target, batch_size(inputs))
            grads = run.gradients(scores, graph, "the attention maps of", names)
            gradients = [
                torch.zeros_like(m) if g is None else g.reshape(m.shape) for m, g in zip(maps, grads, strict=True)
            ]
            if all(g is None for g in grads):
                raise no_dependence("the attention maps of", names[0], scores, checkpointed=run.checkpointed)
            return maps, gradients, output

    def _relevance(self, cls_row: torch.Tensor, inputs: Any, upsample: bool) -> torch.Tensor:
        """The class token's row ``(batch, T)`` without the prefix tokens; a grid for image inputs."""
        row = cls_row[:, self.prefix_tokens :]
        images = inputs.get("pixel_values") if isinstance(inputs, Mapping) else inputs
        if not (isinstance(images, torch.Tensor) and images.dim() == 4):
            return row
        patches = row.shape[-1]
        side = math.isqrt(patches)
        if side * side != patches:
            raise ValueError(
                f"{cls_row.shape[-1]} tokens minus {self.prefix_tokens} prefix token(s) leave {patches} patches, not a "
                "square grid; use .full(inputs) for the (batch, T, T) rollout and arrange the tokens yourself"
            )
        grid = einops.rearrange(row, "b (h w) -> b h w", h=side)
        return cm.upsample(grid, tuple(images.shape[-2:])) if upsample else grid


class AttentionRollout(_Rollout):
    """Attention rollout (Abnar & Zuidema, 2020, https://arxiv.org/abs/2005.00928): the relevance of every token.

    Per layer the heads are fused (``head_fusion``), optionally the lowest entries dropped (``discard_ratio``), then
    ``A_hat = 0.5 A + 0.5 I`` with rows renormalised; the rollout is the product over layers, later layers on the
    left (:func:`attention_rollout`). The result is the class token's row (token 0) without the prefix tokens (the
    class token, and for timm models any distillation or register tokens: ``model.num_prefix_tokens``).

    ``discard_ratio=r`` zeroes, per sample and per layer, the ``floor(r * T * T)`` lowest entries of the fused
    ``T x T`` map, ranked over the whole map, except the entries of the class token's column (column 0), which are
    never dropped; rows are renormalised after the identity is added.

    Returned values are not rescaled: the full rollout's rows sum to 1, so the relevances of an item sum to
    ``1 - R[0, 0]`` (less the other prefix tokens). For display, :func:`attribution.plot.overlay` maps colours from
    0 to the map's maximum (``vmin=None``: from its minimum), and :func:`attribution.plot.show_tokens` min-maxes.

    Args:
        model: a timm ViT/DeiT, a torchvision ``vit_*``, a HuggingFace BERT/ViT-style model, or any model with
            ``layers=``.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.
        discard_ratio: share of the lowest fused entries zeroed per layer, in [0, 1).
        layers: modules whose output is the attention probabilities ``(batch, heads, T, T)`` (for models not
            recognised automatically).

    Example:
        >>> import torchvision
        >>> vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)
        >>> AttentionRollout(vit)(torch.randn(3, 3, 32, 32)).shape  # a 4 x 4 patch grid
        torch.Size([3, 4, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        head_fusion: Fusion = "mean",
        discard_ratio: float = 0.0,
        layers: ModuleTarget | None = None,
    ) -> None:
        _check_options(head_fusion, discard_ratio)
        super().__init__(model, layers=layers)
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio

    def full(self, inputs: Any) -> torch.Tensor:
        """The full rollout ``(batch, T, T)``; row ``i`` is how token ``i`` at the output draws on the input tokens."""
        given = batched(inputs, self.model, images=False)
        with torch.no_grad():
            maps, _, _ = self._capture(given.inputs, with_grad=False)
        full = attention_rollout(maps, head_fusion=self.head_fusion, discard_ratio=self.discard_ratio)
        return full[0] if given.single else full

    def __call__(self, inputs: Any, *, upsample: bool = False) -> torch.Tensor:
        """Relevance of each input token to the class token.

        Args:
            inputs: images ``(batch, C, H, W)`` or one image ``(C, H, W)``, token ids, a tuple of positional inputs,
                or a dict or any ``Mapping`` of keyword inputs (``model(**inputs)``, a HuggingFace ``BatchEncoding``
                or ``BatchFeature``).
            upsample: for images, resize the patch grid bilinearly to the image size.

        Returns:
            ``(batch, grid_h, grid_w)`` for images (``(batch, H, W)`` with ``upsample=True``; no batch axis for one
            image), else ``(batch, tokens)`` without the prefix tokens.
        """
        given = batched(inputs, self.model, images=False)
        with torch.no_grad():
            maps, _, _ = self._capture(given.inputs, with_grad=False)
        row = attention_rollout(maps, head_fusion=self.head_fusion, discard_ratio=self.discard_ratio, row=0)
        relevance = self._relevance(row, given.inputs, upsample)
        return relevance[0] if given.single else relevance


class GradientRollout(_Rollout):
    """Gradient-weighted rollout (Chefer et al., 2021, https://arxiv.org/abs/2103.15679) for a target.

    ``A_bar = mean_heads((dS/dA * A)^+)`` per layer, ``R = I`` then ``R = R + A_bar R`` layer by layer
    (:func:`gradient_rollout`); the result is the class token's row without the prefix tokens. ``S`` is the
    target's score: ``None`` (each item's top class), an int, one int per item, or a callable ``output -> (batch,)``.
    One forward and one backward; the backbone before the first attention layer runs without autograd.

    Args:
        model: as for :class:`AttentionRollout`.
        layers: as for :class:`AttentionRollout`.
    """

    def full(self, inputs: Any, target: Target = None) -> torch.Tensor:
        """The full relevance matrix ``R`` ``(batch, T, T)``."""
        given = batched(inputs, self.model, images=False)
        full = self._compute(given.inputs, target, None)
        return full[0] if given.single else full

    def _compute(self, inputs: Any, target: Target, row: int | None) -> torch.Tensor:
        check_target(target, batch_size(inputs))
        maps, gradients, _ = self._capture(inputs, with_grad=True, target=target)
        return gradient_rollout(maps, gradients, row=row)

    def __call__(self, inputs: Any, target: Target = None, *, upsample: bool = False) -> torch.Tensor:
        """Relevance of each input token for ``target``; inputs and shapes as :meth:`AttentionRollout.__call__`."""
        given = batched(inputs, self.model, images=False)
        relevance = self._relevance(self._compute(given.inputs, target, 0), given.inputs, upsample)
        return relevance[0] if given.single else relevance


_MHA_ARGUMENTS = (
    "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal"
)  # the order of nn.MultiheadAttention.forward's parameters  # fmt: skip


def _check_self_attention(probs: torch.Tensor, name: str) -> None:
    if probs.shape[-1] != probs.shape[-2]:
        raise ValueError(
            f"the attention of {name!r} maps {probs.shape[-2]} queries to {probs.shape[-1]} keys: it is not "
            "self-attention (an encoder-decoder's cross-attention?). Rollout chains self-attention only: pass "
            "layers= with the self-attention modules"
        )


def _probabilities(output: Any, name: str) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 4 and item.shape[-1] == item.shape[-2]:
                return item
    return output
