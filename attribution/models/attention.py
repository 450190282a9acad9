"""Where a model's attention probabilities appear, and what must be switched on to see them for one call.

Recognised without help: timm ``Attention`` modules, ``nn.MultiheadAttention`` (torchvision's ViT) and HuggingFace
self-attention modules; :func:`attention_visible` switches off fused attention (timm) and selects eager attention
(HuggingFace) for the body of a ``with`` block and restores both after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from hooks import ModuleTarget, resolve

__all__ = ["AttentionSite", "attention_visible", "find_attention", "is_hf_attention", "set_attn_implementation"]


@dataclass
class AttentionSite:
    """Where one layer's attention probabilities appear, and what must be switched on to see them."""

    name: str  # the module whose forward hook sees the probabilities
    kind: Literal["probs", "mha", "hf"]  # output is the probabilities / nn.MultiheadAttention / HF (out, weights)
    switch: nn.Module | None = None  # a timm Attention whose fused path is turned off for the call


def find_attention(model: nn.Module, layers: ModuleTarget | None = None) -> list[AttentionSite]:
    """The attention sites of ``model``, in model order.

    Recognised without help: timm ``Attention`` modules (``fused_attn``, probabilities through ``attn_drop``),
    ``nn.MultiheadAttention`` (torchvision's ViT), and HuggingFace self-attention modules (``config`` with an
    attention implementation; eager attention returns the probabilities). ``layers`` names modules whose output is
    the probabilities ``(batch, heads, T, T)`` (or a tuple holding them), for any other model.
    """
    if layers is not None:
        return [AttentionSite(name, "probs") for name, _ in resolve(model, layers, what="`layers`")]
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            sites.append(AttentionSite(name, "mha"))
        elif hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module):
            sites.append(AttentionSite(f"{name}.attn_drop" if name else "attn_drop", "probs", switch=module))
        elif is_hf_attention(module) and not any(is_hf_attention(m) for m in list(module.modules())[1:]):
            sites.append(
                AttentionSite(name, "hf")
            )  # the innermost HuggingFace attention module: it returns the weights
    if not sites:
        raise ValueError(
            f"found no attention in {type(model).__name__}: looked for timm Attention modules (fused_attn, attn_drop), "
            "nn.MultiheadAttention and HuggingFace *Attention modules. Pass layers= with the modules whose output "
            "is the attention probabilities (batch, heads, tokens, tokens), e.g. layers='blocks.*.attn.attn_drop'"
        )
    return sites


def is_hf_attention(module: nn.Module) -> bool:
    """A HuggingFace attention module: an ``...Attention`` class reading ``config._attn_implementation``."""
    return type(module).__name__.endswith("Attention") and hasattr(
        getattr(module, "config", None), "_attn_implementation"
    )


@contextmanager
def attention_visible(model: nn.Module) -> Iterator[None]:
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
            stack.callback(set_attn_implementation, config, config._attn_implementation)
            set_attn_implementation(config, "eager")
        yield


def set_attn_implementation(config: Any, value: str | None) -> None:
    """Set a HuggingFace config's attention implementation (the internal field where the setter is guarded)."""
    try:
        config._attn_implementation = value
    except Exception:  # some versions guard the setter; the internal field is what modules read
        config.__dict__["_attn_implementation_internal"] = value
