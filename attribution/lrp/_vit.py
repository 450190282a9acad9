"""Where AttnLRP's rules go in a Vision Transformer: timm's ``VisionTransformer`` and torchvision's.

* timm: the fused ``attn.qkv`` Linear gets its output's gradient scaled by 0.25 (q), 0.25 (k) and 0.5 (v), chunk by
  chunk; ``mlp.act`` the identity rule; every ``nn.LayerNorm`` the norm rule; the leaf is ``patch_embed.proj``'s
  output ``(batch, hidden, H', W')``; the tokens are read at the input of ``blocks``.
* torchvision: each ``nn.MultiheadAttention`` is given its query, key and value as three views of its input whose
  gradients are scaled 0.25, 0.25 and 0.5 (:func:`~attribution.lrp._transformer.scaled_attention_inputs`); the
  activation of each ``MLPBlock`` the identity rule; the leaf is ``conv_proj``'s output; the tokens are read at the
  input of ``encoder.layers``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._transformer import Sites

__all__ = ["is_vit", "vit_sites"]

_SUPPORTED = (
    "timm VisionTransformer (patch_embed.proj, blocks[i].attn.qkv, blocks[i].mlp.act) and torchvision "
    "VisionTransformer (conv_proj, encoder.layers[i].self_attention as nn.MultiheadAttention)"
)


def _is_timm(model: nn.Module) -> bool:
    embed = getattr(model, "patch_embed", None)
    return isinstance(getattr(embed, "proj", None), nn.Conv2d) and isinstance(getattr(model, "blocks", None), nn.Module)


def _is_torchvision(model: nn.Module) -> bool:
    encoder = getattr(model, "encoder", None)
    return isinstance(getattr(model, "conv_proj", None), nn.Conv2d) and isinstance(
        getattr(encoder, "layers", None), nn.Module
    )


def is_vit(model: nn.Module) -> bool:
    """Whether ``model`` looks like a timm or torchvision Vision Transformer (see :func:`vit_sites`)."""
    return _is_timm(model) or _is_torchvision(model)


def vit_sites(model: nn.Module) -> Sites:
    """Where the rules go in a timm or torchvision ``VisionTransformer``; raises for a block it does not know."""
    if _is_timm(model):
        found = _timm_sites(model)
    elif _is_torchvision(model):
        found = _torchvision_sites(model)
    else:
        raise TypeError(f"AttnLRP handles {_SUPPORTED}; got {type(model).__name__}")
    found.layer_norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    return found


def _timm_sites(model: nn.Module) -> Sites:
    if getattr(model, "global_pool", "token") == "map":
        raise ValueError(
            "AttnLRP does not handle timm's attention pooling head (global_pool='map'); use 'token' or 'avg'"
        )
    found = Sites("patch_embed.proj", {}, [], [], [], [], tokens="blocks")
    blocks = model.get_submodule("blocks")
    for index, block in enumerate(blocks.children()):
        prefix = f"blocks.{index}"
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        qkv = getattr(attn, "qkv", None)
        if (
            not isinstance(qkv, nn.Linear)
            or type(mlp).__name__ != "Mlp"
            or not isinstance(getattr(mlp, "act", None), nn.Module)
        ):
            raise ValueError(
                f"AttnLRP looked for a fused `attn.qkv` Linear and an `Mlp` with an `act` module in {prefix} "
                f"({type(block).__name__}); found attn.qkv={type(qkv).__name__}, mlp={type(mlp).__name__}. "
                f"It handles {_SUPPORTED}"
            )
        d = qkv.out_features // 3
        found.scaled[f"{prefix}.attn.qkv"] = torch.tensor([0.25] * (2 * d) + [0.5] * d)
        found.activations.append(f"{prefix}.mlp.act")
    if not found.scaled:
        raise ValueError(f"AttnLRP found no transformer block in `model.blocks`; it handles {_SUPPORTED}")
    return found


def _torchvision_sites(model: nn.Module) -> Sites:
    found = Sites("conv_proj", {}, [], [], [], [], tokens="encoder.layers")
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
                f"AttnLRP looked for `self_attention` (nn.MultiheadAttention) and an MLP with one activation in "
                f"block {index} ({prefix}); found {type(attention).__name__} and activations {acts}. "
                f"It handles {_SUPPORTED}"
            )
        found.attention_inputs[f"{prefix}.self_attention"] = (0.25, 0.25, 0.5)
        found.activations.extend(acts)
    if not found.attention_inputs:
        raise ValueError(f"AttnLRP found no encoder block in `model.encoder.layers`; it handles {_SUPPORTED}")
    return found
