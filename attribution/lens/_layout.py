"""The layout of the language model, found by :func:`attribution.lens.lm_layout` or given, checked for the lens."""

from __future__ import annotations

from torch import nn

from ..models import LMLayout, lm_layout


def layout_of(model: nn.Module, layout: LMLayout | None, *, unembedding: bool = True) -> LMLayout:
    """``layout``, or the one found in ``model``; its errors say how to pass the names through ``layout=``."""
    if layout is None:
        try:
            layout = lm_layout(model)
        except ValueError as exc:
            raise ValueError(f"{exc}, as `layout=attribution.lens.lm_layout(model, ...)`") from None
    if not isinstance(layout, LMLayout):
        raise TypeError(f"`layout` must be an LMLayout from attribution.lens.lm_layout(model); got {type(layout)}")
    if unembedding and layout.unembed is None:
        raise ValueError(
            "the model has no unembedding (model.get_output_embeddings() is None: a base model without its LM head); "
            "pass a causal LM, or `layout=attribution.lens.lm_layout(model, unembed='<name>')`"
        )
    return layout
