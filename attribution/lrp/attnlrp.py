"""AttnLRP for HuggingFace decoder language models and Vision Transformers (Achtibat et al. 2024), through hooks.

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
is replaced or patched, and the hooks are removed after the call. The rules live in the kernel
(``_transformer_rules.py``), where they go is read by :mod:`attribution.models`; for timm's and torchvision's
``VisionTransformer`` the relevance is read at the patch embedding's output, a ``(batch, H', W')`` map, and at the
blocks' input, per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _maps
from .._run import HookedRun, eager_module, no_dependence, warn
from .._transformer_rules import Sites, register_rules, sites
from ..models import LMLayout, is_vit
from ..targets import Target, check_target, class_indices, class_logits, target_scores
from ._vit import vit_sites

__all__ = ["AttnLRP", "PatchRelevance", "TokenRelevance"]

TokenTarget = int | list[int] | torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


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


@dataclass
class PatchRelevance:
    """The result of :meth:`attribution.AttnLRP.attribute_image` for a Vision Transformer.

    Attributes:
        patches: ``(batch, H', W')``: the relevance of each patch embedding (the patch projection's output, before
            the position embedding is added), summed over the hidden size; row-major as the image.
        tokens: ``(batch, tokens, hidden)``: the relevance of each token at the blocks' input (class and register
            tokens first, as the model orders them; position embedding included), per hidden dimension.
        logits: ``(batch,)``: the explained score of each item.
        targets: ``(batch,)``: the explained class of each item (``-1`` for a callable target).
    """

    patches: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor

    @property
    def conservation(self) -> torch.Tensor:
        """``(batch,)``: the tokens' summed relevance over the explained score (1 up to the biases' share)."""
        return self.tokens.flatten(1).sum(1) / self.logits


# -- the method ----------------------------------------------------------------------------------------------------
class AttnLRP:
    """AttnLRP (Achtibat et al. 2024, https://arxiv.org/abs/2402.05602): relevance of each input token for a logit.

    The same numbers as LXT 2.1's ``monkey_patch`` + gradient times input, for Llama, Qwen2, Mistral and GPT-2
    models of HuggingFace transformers, with the rules applied by hooks (see the module documentation). For timm's
    and torchvision's ``VisionTransformer`` the same rules give the relevance of each patch
    (:meth:`attribute_image`).

    Args:
        model: a HuggingFace causal LM (``...ForCausalLM`` or ``GPT2LMHeadModel``), or a timm or torchvision
            ``VisionTransformer``; it is not modified.
        layout: for a language model whose modules are not found by name, its
            :func:`attribution.models.lm_layout` with the names given (the same keywords in every family).

    Raises:
        TypeError: a model of another kind (the message names what was looked for).

    Example:
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> relevance = AttnLRP(model)(torch.tensor([[3, 14, 15, 9, 2]]), target=7)
        >>> relevance.shape
        torch.Size([1, 5])
        >>> import timm
        >>> vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=(32, 48), embed_dim=16,
        ...     depth=1, num_heads=2, num_classes=3).eval()
        >>> AttnLRP(vit)(torch.randn(2, 3, 32, 48), target=[0, 2]).shape     # a 2 x 3 grid of 16-pixel patches
        torch.Size([2, 2, 3])
    """

    def __init__(self, model: nn.Module, *, layout: LMLayout | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = model
        eager_module(model)  # TorchScript refused with hooks' error, before the structure is read
        if is_vit(model):
            self.sites = vit_sites(model)
        elif layout is not None or callable(getattr(model, "get_input_embeddings", None)):
            self.sites = sites(model, layout)
        else:
            raise TypeError(
                "AttnLRP handles HuggingFace decoder LMs (get_input_embeddings(), attention with q_proj/k_proj/v_proj "
                "or GPT-2's c_attn), timm VisionTransformer (patch_embed.proj, blocks) and torchvision "
                f"VisionTransformer (conv_proj, encoder.layers); got {type(model).__name__}, which has none of these"
            )

    def __call__(
        self, inputs: Any, target: Any = None, position: int = -1, reduce: bool = True, *, upsample: bool = False
    ) -> torch.Tensor:
        """The relevance of each input token for ``target``'s logit: ``(batch, tokens)``, or ``(batch, H', W')``.

        Args:
            inputs: for a language model ``(batch, tokens)`` token ids, or a mapping of model inputs (a tokenizer's
                ``BatchEncoding`` with ``input_ids`` and ``attention_mask``); for a ViT ``(batch, 3, H, W)`` images.
            target: ``None`` (the predicted token or class), a token id or class, one per item, or a callable
                ``logits (batch, vocab) -> (batch,)`` (a ViT: ``output -> (batch,)``, see :mod:`attribution.targets`).
            position: LMs: the position whose logits are explained (default the last).
            reduce: LMs: sum over the hidden size (``False``: ``(batch, tokens, hidden)``).
            upsample: ViTs: resize the patch map bilinearly to the image size, for display (the resized map's sum is
                not the patches').

        Returns:
            LMs: ``(batch, tokens)``; ViTs: the patch map ``(batch, H', W')``, or ``(batch, H, W)`` with
            ``upsample=True`` (:meth:`attribute_image` for more).
        """
        if self.sites.tokens is not None:
            if position != -1 or not reduce:
                raise ValueError(
                    "`position` and `reduce` are for language models; for a ViT, attribute_image(...).tokens holds "
                    "each token's relevance per hidden dimension"
                )
            patches = self.attribute_image(inputs, target).patches
            return _maps.upsample(patches, tuple(inputs.shape[-2:])) if upsample else patches
        if upsample:
            raise ValueError(
                "`upsample` is for Vision Transformers' patch maps; a language model's relevance is per token"
            )
        return self.attribute(inputs, target, position, reduce).relevance

    def attribute(
        self, input_ids: Any, target: TokenTarget = None, position: int = -1, reduce: bool = True
    ) -> TokenRelevance:
        """As calling the object, with the explained logits and the conservation (:class:`TokenRelevance`)."""
        if self.sites.tokens is not None:
            raise TypeError("AttnLRP.attribute is for language models; for a ViT call attribute_image(images, target)")
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

    def attribute_image(self, images: torch.Tensor, target: Target = None) -> PatchRelevance:
        """AttnLRP of a timm or torchvision ``VisionTransformer``: each patch's and token's relevance for the target.

        Args:
            images: ``(batch, channels, height, width)``.
            target: as the CAMs' (:mod:`attribution.targets`): ``None`` (each item's top class), a class, one class
                per item, or a callable ``output -> (batch,)`` scores.

        Returns:
            A :class:`PatchRelevance`: ``.patches`` ``(batch, H', W')``, ``.tokens`` ``(batch, tokens, hidden)``.

        Raises:
            TypeError: a language model, or ``images`` that are not a 4-D floating-point tensor.
        """
        if self.sites.tokens is None:
            raise TypeError("AttnLRP.attribute_image is for Vision Transformers; call attribute(input_ids) for an LM")
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.is_floating_point():
            got = f"{tuple(images.shape)} {images.dtype}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise TypeError(f"`images` must be a float tensor (batch, channels, height, width); got {got}")
        batch = len(images)
        check_target(target, batch)
        with HookedRun(self.model, "AttnLRP", with_grad=True) as run:
            seen = _register_vit(run, self.sites)
            output = run.forward(images)
            if callable(target):
                scores, ids = target_scores(output, target, batch), torch.full((batch,), -1, dtype=torch.long)
            else:
                ids = class_indices(class_logits(output), target, batch)
                scores = target_scores(output, ids, batch)
            if "patches" not in seen or not scores.requires_grad:
                raise no_dependence("the patch embedding", self.sites.embedding, scores)
            patch_grad, token_grad = torch.autograd.grad(scores.sum(), [seen["patches"], seen["tokens"]])
        patches = (seen["patches"] * patch_grad).detach().sum(1)
        tokens = (seen["tokens"] * token_grad).detach()
        if not bool(torch.isfinite(tokens).all()):
            warn("AttnLRP relevance has NaN or infinite entries: the model overflows in this dtype; try float32/64")
        return PatchRelevance(patches, tokens, scores.detach(), ids.detach().cpu())


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


def _register(run: HookedRun, where: Sites) -> list[torch.Tensor]:
    """The rules' hooks and the input leaf on ``run.group``; returns the list that will hold the embedding output."""
    embedded: list[torch.Tensor] = []

    def leaf(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        new = run.leaf(output)
        embedded.append(new)
        return new

    run.group.forward(where.embedding, leaf)
    register_rules(run.group, where)
    return embedded


def _register_vit(run: HookedRun, where: Sites) -> dict[str, torch.Tensor]:
    """The rules, the patch leaf and the tokens' tap on ``run.group``; returns the dict that will hold both."""
    seen: dict[str, torch.Tensor] = {}

    def leaf(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        seen["patches"] = run.leaf(output)
        return seen["patches"]

    def tokens(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen["tokens"] = args[0]

    assert where.tokens is not None
    run.group.forward(where.embedding, leaf)
    run.group.forward_pre(where.tokens, tokens)
    register_rules(run.group, where)
    return seen
