"""Where a graph's writers and readers are in the model, as hooks of one :class:`hooks.HookGroup`.

Each callback gets ``(layer, tensor)`` and may return a tensor that replaces the one at the site:

* ``embed``: the input of the first decoder layer (the ``embed`` writer);
* ``attn_input``: the input of a layer's attention norm (the residual stream its attention readers read);
* ``projection``: ``(layer, kind, output)`` of a q, k, v or fused qkv projection;
* ``heads``: the input of the attention output projection (the heads side by side);
* ``mlp_input``: the input of a layer's MLP norm (the residual stream the MLP reads);
* ``mlp_output``: the MLP's output (the ``m{L}`` writer);
* ``final_input``: the input of the final norm (the ``logits`` reader); its layer is ``len(layers)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._run import hook_site
from ..models import linear
from .graph import Graph

Site = Callable[[int, torch.Tensor], "torch.Tensor | None"]
Projection = Callable[[int, str, torch.Tensor], "torch.Tensor | None"]


def hook_graph(
    group: HookGroup,
    graph: Graph,
    *,
    embed: Site | None = None,
    attn_input: Site | None = None,
    projection: Projection | None = None,
    heads: Site | None = None,
    mlp_input: Site | None = None,
    mlp_output: Site | None = None,
    final_input: Site | None = None,
) -> None:
    """Register the callbacks that are given (see the module documentation)."""
    layers = graph.layers

    def at(fn: Site, names: list[str]) -> Callable[[torch.Tensor, str, int], Any]:
        index = {name: i for i, name in enumerate(names)}
        return lambda tensor, name, call: fn(index[name], tensor)

    def register(fn: Site | None, names: list[str], site: Any) -> None:
        if fn is not None and names:
            hook_site(group, names, site, None, at(fn, names))

    register(embed, [layers[0].name] if layers else [], "input")
    register(attn_input, [layer.attn_norm for layer in layers], "input")
    if projection is not None:
        kinds = {getattr(layer, kind): (i, kind) for i, layer in enumerate(layers) for kind in ("q", "k", "v", "qkv")}
        kinds.pop(None, None)

        def project(tensor: torch.Tensor, name: str, call: int) -> torch.Tensor | None:
            layer, kind = kinds[name]
            return projection(layer, kind, tensor)

        hook_site(group, [n for n in kinds if n is not None], "output", None, project)
    register(heads, [layer.o for layer in layers], "input")
    register(mlp_input, [layer.mlp_norm for layer in layers], "input")
    register(mlp_output, [layer.mlp for layer in layers], "output")
    if final_input is not None:
        end = len(layers)
        hook_site(group, [graph.final_norm], "input", None, lambda tensor, name, call: final_input(end, tensor))


def reader_slice(graph: Graph, kind: str) -> slice:
    """The readers of a ``q``, ``k``, ``v`` or fused ``qkv`` projection among a layer's attention readers."""
    h, g = graph.n_heads, graph.n_groups
    return {"q": slice(0, h), "k": slice(h, h + g), "v": slice(h + g, h + 2 * g)}.get(kind, slice(0, h + 2 * g))


def reader_weights(model: nn.Module, graph: Graph, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention readers' weight slices ``(readers, d_head, d_model)`` and biases ``(readers, d_head)``."""
    spec = graph.layers[layer]
    names = [spec.qkv] if spec.qkv is not None else [spec.q, spec.k, spec.v]
    parts = [linear(model.get_submodule(name)) for name in names if name is not None]
    weight = torch.cat([w for w, _ in parts])
    full = torch.cat([torch.zeros(len(w), dtype=w.dtype, device=w.device) if b is None else b for w, b in parts])
    rows = graph.attention_readers * graph.d_head
    if len(weight) != rows:
        raise ValueError(
            f"the q/k/v projections of layer {layer} have {len(weight)} output features; {graph.n_heads} query "
            f"heads and {graph.n_groups} key/value groups of {graph.d_head} need {rows}"
        )
    return weight.unflatten(0, (-1, graph.d_head)), full.unflatten(0, (-1, graph.d_head))


def head_weights(model: nn.Module, graph: Graph, layer: int) -> torch.Tensor:
    """The attention output projection's weight as ``(d_model, heads * d_head)``."""
    weight, _ = linear(model.get_submodule(graph.layers[layer].o))
    if weight.shape[1] != graph.n_heads * graph.d_head:
        raise ValueError(
            f"the attention output projection of layer {layer} takes {weight.shape[1]} features, not "
            f"{graph.n_heads} heads x {graph.d_head}: it has no per-head layout"
        )
    return weight
