"""Where AttnLRP's rules go in a Vision Transformer, from :func:`attribution.models.vit_layout`.

* timm: the fused ``attn.qkv`` Linear gets its output's gradient scaled by 0.25 (q), 0.25 (k) and 0.5 (v), chunk by
  chunk; ``mlp.act`` the identity rule; every ``nn.LayerNorm`` the norm rule; the leaf is ``patch_embed.proj``'s
  output ``(batch, hidden, H', W')``; the tokens are read at the input of ``blocks``.
* torchvision: each ``nn.MultiheadAttention`` is given its query, key and value as three views of its input whose
  gradients are scaled 0.25, 0.25 and 0.5 (:func:`~attribution._transformer_rules.scaled_attention_inputs`); the
  activation of each ``MLPBlock`` the identity rule; the leaf is ``conv_proj``'s output; the tokens are read at the
  input of ``encoder.layers``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._transformer_rules import Sites
from ..models import vit_layout

__all__ = ["vit_sites"]


def vit_sites(model: nn.Module) -> Sites:
    """Where the rules go in a timm or torchvision ``VisionTransformer``; raises for a block it does not know."""
    try:
        layout = vit_layout(model)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"AttnLRP: {exc}") from None
    found = Sites(layout.patch_embed, {}, [], [], [], list(layout.layer_norms), tokens=layout.tokens)
    for block in layout.blocks:
        if block.qkv is not None:
            qkv = model.get_submodule(block.qkv)
            d = qkv.out_features // 3 if isinstance(qkv, nn.Linear) else 0  # vit_layout checked it is a Linear
            found.scaled[block.qkv] = torch.tensor([0.25] * (2 * d) + [0.5] * d)
        else:
            found.attention_inputs[block.attention] = (0.25, 0.25, 0.5)
        found.activations.append(block.act)
    return found
