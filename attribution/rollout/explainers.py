"""The rollout explainers: capture the attention maps of one forward, then turn them into relevances."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import einops
import torch
from torch import nn

from hooks import ModuleTarget, in_backward

from .. import _maps
from .._diagnose import ZERO_HEAD, items, output_ignores_input
from .._inputs import batch_size, batched
from .._run import HookedRun, SiteValueError, eager_module, no_dependence, warn
from ..models import attention_visible, find_attention
from ..targets import Target, check_target, target_scores
from ._math import Fusion, attention_rollout, check_options, gradient_rollout
from ._sites import MHA_ARGUMENTS, check_global, check_self_attention, probabilities


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
        taken: list[str] = []  # the site of each map

        def before_mha(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            kwargs = {**dict(zip(MHA_ARGUMENTS[3:], args[3:], strict=False)), **kwargs}  # positional options too
            asked.append((bool(kwargs.get("need_weights", True)), bool(kwargs.get("average_attn_weights", True))))
            return args[:3], {**kwargs, "need_weights": True, "average_attn_weights": False}

        def start_graph(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not with_grad or (run.started and not in_backward()):  # a checkpoint's recomputation repeats the leaf
                return None
            return run.leaf(args), run.leaf(kwargs)  # the backbone before the first attention keeps no graph

        def after(module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str) -> Any:
            if in_backward():  # gradient checkpointing recomputes the forward: the maps were taken the first time
                return None
            site = next(s for s in self.sites if s.name == name)
            if site.kind == "mha":
                weights = output[1]
                need, average = asked.pop()
                check_self_attention(weights, name)
                taken.append(name)
                maps.append(weights.detach())
                graph.append(weights._base if weights._base is not None else weights)
                shown = (weights.mean(dim=1) if average else weights) if need else None
                return output[0], shown
            probs = output[1] if site.kind == "hf" else probabilities(output, name)
            if not isinstance(probs, torch.Tensor) or probs.dim() != 4:
                raise SiteValueError(
                    f"`layers` {name!r} gave {type(probs).__name__} {tuple(getattr(probs, 'shape', ()))}; attention "
                    "probabilities (batch, heads, tokens, tokens) were expected"
                )
            check_self_attention(probs, name)
            taken.append(name)
            maps.append(probs.detach())
            graph.append(probs)
            return None

        names = [s.name for s in self.sites]
        with HookedRun(self.model, type(self).__name__, with_grad=with_grad) as run, attention_visible(self.model):
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
            check_global(self.model, maps, taken, batch_size(inputs))
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
        return _maps.upsample(grid, tuple(images.shape[-2:])) if upsample else grid


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
        check_options(head_fusion, discard_ratio)
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
        zero = (relevance.flatten(1).abs().amax(1) == 0).nonzero().flatten().tolist()
        if zero:
            warn(
                f"the gradient rollout is all zero for {items(zero)}: no attention map's gradient x attention has a "
                "positive entry. "
                + (
                    ZERO_HEAD
                    if output_ignores_input(self.model)
                    else "Check that the target's score depends on the input"
                )
            )
        return relevance[0] if given.single else relevance
