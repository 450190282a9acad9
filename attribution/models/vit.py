"""Where things are in a Vision Transformer: the patch embedding, the token sequence, each block's attention and MLP.

:func:`vit_layout` reads timm's ``VisionTransformer`` (``patch_embed.proj``, ``blocks[i].attn.qkv``,
``blocks[i].mlp.act``) and torchvision's (``conv_proj``, ``encoder.layers[i].self_attention`` as an
``nn.MultiheadAttention``). Blocks it does not know (a gated MLP, timm's attention-pooling head) are refused with
what was looked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from .norms import norm_kind

__all__ = ["ViTBlock", "ViTLayout", "is_vit", "vit_layout"]

SUPPORTED = (
    "timm VisionTransformer (patch_embed.proj, blocks[i].attn.qkv, blocks[i].mlp.act) and torchvision "
    "VisionTransformer (conv_proj, encoder.layers[i].self_attention as nn.MultiheadAttention)"
)


@dataclass(frozen=True)
class ViTBlock:
    """One block's attention (with timm's fused ``qkv`` Linear, or an ``nn.MultiheadAttention``) and activation."""

    module: str
    attention: str
    act: str
    qkv: str | None = None


@dataclass(frozen=True)
class ViTLayout:
    """Qualified module names of a Vision Transformer (see :func:`vit_layout`)."""

    kind: Literal["timm", "torchvision"]
    patch_embed: str
    """The patch embedding convolution; its output ``(batch, hidden, H', W')`` is the patch grid."""
    tokens: str
    """The module whose first input is the token sequence (class token and position embedding added)."""
    blocks: tuple[ViTBlock, ...]
    layer_norms: tuple[str, ...]


def _is_timm(model: nn.Module) -> bool:
    embed = getattr(model, "patch_embed", None)
    return isinstance(getattr(embed, "proj", None), nn.Conv2d) and isinstance(getattr(model, "blocks", None), nn.Module)


def _is_torchvision(model: nn.Module) -> bool:
    encoder = getattr(model, "encoder", None)
    return isinstance(getattr(model, "conv_proj", None), nn.Conv2d) and isinstance(
        getattr(encoder, "layers", None), nn.Module
    )


def is_vit(model: nn.Module) -> bool:
    """Whether ``model`` looks like a timm or torchvision Vision Transformer (see :func:`vit_layout`)."""
    return _is_timm(model) or _is_torchvision(model)


def vit_layout(model: nn.Module) -> ViTLayout:
    """The layout of a timm or torchvision ``VisionTransformer``.

    Raises:
        TypeError: not a Vision Transformer of either kind.
        ValueError: a block it does not know (naming what was looked for and what was found).

    Example:
        >>> import timm
        >>> vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=16, depth=2, num_heads=2)
        >>> layout = vit_layout(vit)
        >>> layout.kind, layout.blocks[1].qkv, layout.blocks[1].act, layout.tokens
        ('timm', 'blocks.1.attn.qkv', 'blocks.1.mlp.act', 'blocks')
    """
    layer_norms = tuple(name for name, module in model.named_modules() if norm_kind(module) == "layer")
    if _is_timm(model):
        return ViTLayout("timm", "patch_embed.proj", "blocks", _timm_blocks(model), layer_norms)
    if _is_torchvision(model):
        return ViTLayout("torchvision", "conv_proj", "encoder.layers", _torchvision_blocks(model), layer_norms)
    raise TypeError(f"expected a Vision Transformer: {SUPPORTED}; got {type(model).__name__}")


def _timm_blocks(model: nn.Module) -> tuple[ViTBlock, ...]:
    if getattr(model, "global_pool", "token") == "map":
        raise ValueError("timm's attention pooling head (global_pool='map') is not handled; use 'token' or 'avg'")
    blocks = []
    for index, block in enumerate(model.get_submodule("blocks").children()):
        prefix = f"blocks.{index}"
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        qkv = getattr(attn, "qkv", None)
        if (
            not isinstance(qkv, nn.Linear)
            or type(mlp).__name__ != "Mlp"
            or not isinstance(getattr(mlp, "act", None), nn.Module)
        ):
            raise ValueError(
                f"looked for a fused `attn.qkv` Linear and an `Mlp` with an `act` module in {prefix} "
                f"({type(block).__name__}); found attn.qkv={type(qkv).__name__}, mlp={type(mlp).__name__}. "
                f"Handled: {SUPPORTED}"
            )
        blocks.append(ViTBlock(prefix, f"{prefix}.attn", f"{prefix}.mlp.act", qkv=f"{prefix}.attn.qkv"))
    if not blocks:
        raise ValueError(f"found no transformer block in `model.blocks`; handled: {SUPPORTED}")
    return tuple(blocks)


def _torchvision_blocks(model: nn.Module) -> tuple[ViTBlock, ...]:
    blocks = []
    for index, (name, block) in enumerate(model.get_submodule("encoder.layers").named_children()):
        prefix = f"encoder.layers.{name}"
        attention, mlp = getattr(block, "self_attention", None), getattr(block, "mlp", None)
        acts = [
            f"{prefix}.mlp.{n}"
            for n, m in (mlp.named_children() if isinstance(mlp, nn.Sequential) else [])
            if not isinstance(m, nn.Linear | nn.Dropout)
        ]
        if not isinstance(attention, nn.MultiheadAttention) or len(acts) != 1:
            raise ValueError(
                f"looked for `self_attention` (nn.MultiheadAttention) and an MLP with one activation in "
                f"block {index} ({prefix}); found {type(attention).__name__} and activations {acts}. "
                f"Handled: {SUPPORTED}"
            )
        blocks.append(ViTBlock(prefix, f"{prefix}.self_attention", acts[0]))
    if not blocks:
        raise ValueError(f"found no encoder block in `model.encoder.layers`; handled: {SUPPORTED}")
    return tuple(blocks)
