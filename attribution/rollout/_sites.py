"""Finding the attention probabilities in a model, and switching on what is needed to see them for one call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hooks import ModuleTarget, resolve

from .._run import SiteValueError


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
    try:
        config._attn_implementation = value
    except Exception:  # some versions guard the setter; the internal field is what modules read
        config.__dict__["_attn_implementation_internal"] = value


MHA_ARGUMENTS = (
    "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal"
)  # the order of nn.MultiheadAttention.forward's parameters  # fmt: skip


def check_global(model: nn.Module, maps: list[torch.Tensor], names: list[str], batch: int) -> None:
    """Rollout chains attention over the same tokens in every layer: refuse windowed and changing token sets."""
    for probs, name in zip(maps, names, strict=True):
        if probs.shape[0] != batch:
            stage = _last_stage(model)
            raise ValueError(
                f"the attention of {name!r} is within windows: its attention is {tuple(probs.shape)} for a batch of "
                f"{batch} ({probs.shape[0] / batch:g} windows per image). Rollout needs global token attention, the "
                "same tokens attending to each other in every layer; windowed and hierarchical models (Swin, "
                "MaxViT, CoAtNet) do not have it. Explain them with a CAM at a stage output"
                + (f", e.g. GradCAM(model, {stage!r})" if stage else "")
            )
    sizes = [int(p.shape[-1]) for p in maps]
    if len(set(sizes)) > 1:
        last = [n for n, t in zip(names, sizes, strict=True) if t == sizes[-1]]
        raise ValueError(
            f"the attention maps change size between layers ({names[0]!r}: {sizes[0]} tokens, {names[-1]!r}: "
            f"{sizes[-1]} tokens; hierarchical stages, or a class token that joins late as in ConViT): rollout needs "
            f"every layer to attend over the same tokens. Pass `layers=` with the layers over the last {sizes[-1]} "
            f"tokens only: {list(dict.fromkeys(last))}"
        )


def _last_stage(model: nn.Module) -> str | None:
    """The last entry of a top-level ``stages``/``layers`` list (Swin, MaxViT, CoAtNet), if the model has one."""
    for list_name in ("stages", "layers"):
        stages = getattr(model, list_name, None)
        if isinstance(stages, (nn.ModuleList, nn.Sequential)) and len(stages) > 0:
            return f"{list_name}.{len(stages) - 1}"
    return None


def check_self_attention(probs: torch.Tensor, name: str) -> None:
    """Refuse attention from other queries than keys (cross-attention, CaiT's class attention)."""
    if probs.shape[-1] != probs.shape[-2]:
        raise SiteValueError(
            f"the attention of {name!r} maps {probs.shape[-2]} queries to {probs.shape[-1]} keys: it is not "
            "self-attention (an encoder-decoder's cross-attention, or a class-attention block where only the class "
            "token queries, as in CaiT). Rollout chains self-attention only: pass `layers=` with the "
            "self-attention modules (CaiT: layers='blocks.*.attn.attn_drop')"
        )


def probabilities(output: Any, name: str) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 4 and item.shape[-1] == item.shape[-2]:
                return item
    return output
