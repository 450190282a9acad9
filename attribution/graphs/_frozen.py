"""The frozen model of one prompt, kept with its autograd graph, and its rows by batched gradient injection.

One forward of the real model with hooks (one :class:`attribution._run.HookedRun` group):

* the first layer's input becomes a leaf: the token nodes' vectors;
* every LayerNorm/RMSNorm gets the LN-rule (its scale ``1 / std`` or ``1 / rms`` held at the clean value);
* the query and key projections' outputs are detached, so the attention probabilities are constants;
* each MLP's down projection gets a new leaf as its input (the neuron activations, held), and the activation as
  computed is kept as that layer's targets;
* with ``rules="relp"``, RelP's rules go on first (identity rule on the activation, half rule on a gated product).

In this graph the only paths from a source to a target pass through no other node, and a target's activation is
differentiated at the clean point (or through RelP's rules). A row is ``a_s * d a_t / d a_s`` for every source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._relp import relp_sites
from .._run import HookedRun, hook_site
from .._transformer_rules import Sites, register_rules
from ..models import LMLayout, linear, logit_softcap
from ._math import kept_entries


@dataclass
class Frozen:
    """The tensors of one frozen run: sources (leaves), targets (in the graph) and the clean logits."""

    layout: LMLayout
    tokens: torch.Tensor | None = None  # (1, T, d): the first layer's input, a leaf
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, d_mlp) leaf, the held neurons
    targets: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, d_mlp) computed activations
    final: torch.Tensor | None = None  # (1, T, d): the final norm's output
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (vocab,) at the last position
    runs: int = 0  # backward runs of the autograd engine

    @property
    def width(self) -> int:
        """Neurons per layer."""
        return int(self.leaves[0].shape[-1])

    @property
    def positions(self) -> int:
        """Prompt length."""
        return int(self.leaves[0].shape[1])

    def column(self, layer: int) -> int:
        """The first source column of ``layer``'s neurons (tokens come first, one column per position)."""
        return self.positions * (1 + layer * self.width)

    @property
    def n_columns(self) -> int:
        """Source columns: one per position, then one per (layer, position, neuron)."""
        return self.column(len(self.leaves))


def register(run: HookedRun, model: nn.Module, layout: LMLayout, rules: str | None) -> Frozen:
    """Put the frozen model's hooks on ``run.group`` (see the module documentation); the run fills the result."""
    frozen = Frozen(layout)
    group = run.group
    if rules == "relp":
        found = relp_sites(model, "relp", layout)
        assert found is not None
        register_rules(group, found)
    else:
        rms = [name for name, kind in layout.norms if kind == "rms"]
        register_rules(group, Sites(layout.embed, {}, [], [], rms, [n for n, k in layout.norms if k == "layer"]))
    _freeze_attention(group, layout)
    index = {}
    for layer in layout.layers:
        assert layer.mlp_parts is not None
        index[layer.mlp_parts.neurons] = layer.index

    def tokens(x: torch.Tensor, name: str, call: int) -> torch.Tensor:
        frozen.tokens = run.leaf(x)
        return frozen.tokens

    def neurons(a: torch.Tensor, name: str, call: int) -> torch.Tensor:
        layer = index[name]
        frozen.targets[layer] = a
        frozen.leaves[layer] = a.detach().clone().requires_grad_(True)
        return frozen.leaves[layer]

    def final(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        frozen.final = output

    hook_site(group, layout.layers[0].module, "input", None, tokens)
    hook_site(group, list(index), "input", None, neurons)
    group.forward(layout.final_norm, final)
    return frozen


def _freeze_attention(group: HookGroup, layout: LMLayout) -> None:
    """Detach the query and key projections' outputs: the attention probabilities become constants."""
    separate = [name for layer in layout.layers for name in (layer.attention.q, layer.attention.k) if name]
    fused = [layer.attention.qkv for layer in layout.layers if layer.attention.qkv]
    queries_keys = (layout.n_heads + layout.n_kv_heads) * layout.head_dim

    def detach(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.detach()

    def detach_blocks(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.cat([output[..., :queries_keys].detach(), output[..., queries_keys:]], -1)

    if separate:
        group.forward(separate, detach)
    if fused:
        group.forward([str(name) for name in fused], detach_blocks)


def logit_vectors(model: nn.Module, frozen: Frozen, ids: torch.Tensor, foils: torch.Tensor) -> torch.Tensor:
    """``(k, d)``: the gradient of each logit node's value with respect to the final norm's output.

    A token's value is its logit minus the mean logit (``W_U[token] - mean(W_U)``), a pair's the difference of its
    two logits (``W_U[token] - W_U[foil]``); under Gemma 2's soft-capping each logit's derivative multiplies its row.
    """
    assert frozen.final is not None
    assert frozen.layout.unembed is not None
    weight, _ = linear(model.get_submodule(frozen.layout.unembed), device=frozen.final.device)
    weight = weight.to(frozen.final.dtype)
    ids, foils = ids.to(weight.device), foils.to(weight.device)
    slope = torch.ones(weight.shape[0], dtype=weight.dtype, device=weight.device)
    cap = logit_softcap(model)
    if cap is not None:
        slope = 1 - (frozen.logits.to(weight.dtype) / cap).pow(2)  # logits are already capped: tanh(z / c) = l / c
    rows = slope[ids, None] * weight[ids]
    paired = foils >= 0
    mean = (slope[:, None] * weight).mean(0)
    other = torch.where(paired[:, None], slope[foils.clamp_min(0), None] * weight[foils.clamp_min(0)], mean)
    return rows - other


@dataclass
class Rows:
    """Kept entries of a batch of rows: ``(rows, k)`` source columns and values, and each row's full ``sum |entry|``."""

    columns: torch.Tensor
    values: torch.Tensor
    abs_sums: torch.Tensor


def neuron_rows(frozen: Frozen, targets: torch.Tensor, keep: int) -> Rows:
    """The rows of neuron targets ``(rows, 3)`` (layer, position, neuron), in one backward pass."""
    shapes = {layer: frozen.targets[layer].shape for layer in torch.unique(targets[:, 0]).tolist()}
    outputs, cotangents = [], []
    rows = torch.arange(len(targets))
    for layer, shape in shapes.items():
        mine = targets[:, 0] == layer
        cotangent = frozen.targets[layer].new_zeros(len(targets), *shape)
        cotangent[rows[mine], 0, targets[mine, 1], targets[mine, 2]] = 1
        outputs.append(frozen.targets[layer])
        cotangents.append(cotangent)
    return _rows(frozen, outputs, cotangents, max(shapes), keep)


def logit_rows(frozen: Frozen, vectors: torch.Tensor, keep: int) -> Rows:
    """The rows of logit targets, given their vectors ``(rows, d)`` at the final norm's output (last position)."""
    assert frozen.final is not None
    cotangent = frozen.final.new_zeros(len(vectors), *frozen.final.shape)
    cotangent[:, 0, -1] = vectors.to(cotangent.dtype)
    return _rows(frozen, [frozen.final], [cotangent], len(frozen.leaves), keep)


def _rows(frozen: Frozen, outputs: list[torch.Tensor], cotangents: list[torch.Tensor], below: int, keep: int) -> Rows:
    """One batched backward from ``outputs``; the products ``a_s * gradient`` at every source below layer ``below``."""
    assert frozen.tokens is not None
    inputs = [frozen.tokens] + [frozen.leaves[layer] for layer in range(below)]
    grads = torch.func.vmap(_vjp(outputs, inputs))(cotangents)  # one run of the engine, the cotangents batched
    frozen.runs += 1
    batch = len(cotangents[0])
    products = inputs[0].new_zeros(batch, frozen.column(below))
    token_grad = grads[0] if grads[0] is not None else torch.zeros_like(inputs[0]).expand(batch, *inputs[0].shape)
    products[:, : frozen.positions] = (token_grad * inputs[0]).sum(-1).flatten(1)
    for layer in range(below):
        grad = grads[1 + layer]
        if grad is not None:
            span = slice(frozen.column(layer), frozen.column(layer + 1))
            products[:, span] = (grad * frozen.leaves[layer]).flatten(1)
    columns, values, sums = kept_entries(products, keep)
    return Rows(columns, values, sums)


def _vjp(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    """``cotangents -> d outputs / d inputs`` transposed (``None`` for an input the outputs do not reach)."""

    def vjp(cotangents: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True, allow_unused=True)

    return vjp
