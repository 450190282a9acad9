"""Attention rollout (Abnar & Zuidema, 2020) and gradient-weighted rollout (Chefer et al., 2021).

The arithmetic is in pure functions of attention maps ``(batch, heads, tokens, tokens)``; the classes find the
attention probabilities in a model, switch on what is needed to see them for one call, and put everything back.
"""

from ..models import find_attention
from ._math import attention_rollout, discard_lowest, fuse_heads, gradient_rollout
from .explainers import AttentionRollout, GradientRollout

__all__ = [
    "AttentionRollout",
    "GradientRollout",
    "attention_rollout",
    "discard_lowest",
    "find_attention",
    "fuse_heads",
    "gradient_rollout",
]
