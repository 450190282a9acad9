"""The one reader of model structure, and the one accessor of weights: every family asks here.

Where things are in a model is found in this package and nowhere else:

* :func:`lm_layout`: a decoder-only language model's embeddings, layers, attention projections with their q/k/v
  layout and head counts, MLP parts (gate/up/down or fc/proj, the activation module, the neuron site), norms with
  their kind, the final norm, the unembedding, a parallel residual or not, Gemma's soft-capping, whether the forward
  takes a key/value cache (:func:`cache_keyword`). Unknown models are read with explicit names, the same
  keywords everywhere.
* :func:`gated_mlps`: every gated MLP of any model (``gate_proj``/``up_proj``/``down_proj`` and the activation).
* :func:`vit_layout`: a timm or torchvision Vision Transformer's patch embedding, tokens, blocks.
* :func:`find_attention`: where the attention probabilities appear (rollout), and :func:`attention_visible` to see
  them for one call.
* :func:`weight` and :func:`linear`: every weight read outside a forward, real also when accelerate offloaded the
  module (CPU or disk: loaded for the read, released after); :func:`execution_device`: where a module computes.
* :func:`norm_affine`, :func:`rms_norm_gain`: norms read as affine maps after a frozen scale, with their gain
  convention (``weight`` or Gemma's ``1 + weight``).

The readers read names and the config; weights only through :func:`weight`. So a model dispatched with
``device_map`` (several devices, or layers offloaded to CPU or disk) is read as the plain one.
"""

from .attention import AttentionSite, attention_visible, find_attention, is_hf_attention, set_attn_implementation
from .lm import (
    AttentionLayout,
    LayerLayout,
    LMLayout,
    MLPLayout,
    cache_keyword,
    check_heads,
    gated_mlps,
    heads_at,
    lm_layout,
    logit_softcap,
    takes_logits_to_keep,
)
from .norms import NormAffine, NormKind, is_rms_norm, norm_affine, norm_eps, norm_kind, rms_norm_gain
from .vit import ViTBlock, ViTLayout, is_vit, vit_layout
from .weights import execution_device, has_offloaded_weights, linear, weight

__all__ = [
    "AttentionLayout",
    "AttentionSite",
    "LMLayout",
    "LayerLayout",
    "MLPLayout",
    "NormAffine",
    "NormKind",
    "ViTBlock",
    "ViTLayout",
    "attention_visible",
    "cache_keyword",
    "check_heads",
    "execution_device",
    "find_attention",
    "gated_mlps",
    "has_offloaded_weights",
    "heads_at",
    "is_hf_attention",
    "is_rms_norm",
    "is_vit",
    "linear",
    "lm_layout",
    "logit_softcap",
    "norm_affine",
    "norm_eps",
    "norm_kind",
    "rms_norm_gain",
    "set_attn_implementation",
    "takes_logits_to_keep",
    "vit_layout",
    "weight",
]
