"""The frozen model of one prompt, kept with its autograd graph, and its rows by batched gradient injection.

One forward of the real model with hooks (one :class:`attribution._run.HookedRun` group):

* the first layer's input becomes a leaf: the token nodes' vectors;
* every LayerNorm/RMSNorm gets the LN-rule (its scale ``1 / std`` or ``1 / rms`` held at the clean value);
* the query and key projections' outputs are detached, so the attention probabilities are constants, and each
  layer's attention is written again so that its backward is one product for all rows of a batch
  (:mod:`attribution.graphs._attention`);
* each MLP's down projection gets a new leaf as its input (the neuron activations, held), and the activation as
  computed is kept as that layer's targets; the MLP's input and its up (and gate) projections' outputs are kept too;
* at an MLP with a dictionary instead (:func:`dictionary_hooks`), the features as computed are the targets and the
  MLP writes ``decode(features) (+ skip) + error`` from two leaves, the held features and the held error;
* with ``rules="relp"``, RelP's rules go on first (identity rule on the activation, half rule on a gated product).

In this graph the only paths from a source to a target pass through no other node, and a target's activation is
differentiated at the clean point (or through RelP's rules). A row is ``a_s * d a_t / d a_s`` for every source.

A neuron's rows are injected at its MLP's input, not at the neuron: a neuron ``i`` at position ``p`` depends on the
MLP's input ``x`` there only, through its own entries of the up (and gate) projections' outputs ``z``, so
``d a / d x[p] = sum_z (d a / d z[p, i]) W_z[i]``. The slopes ``d a / d z`` are elementwise; one backward pass with a
cotangent of ones reads them all (:func:`neuron_slopes`). A batch of rows then skips the MLP's up and gate
projections, whose backward for every row of the batch at every target layer was most of its cost.

Source columns: one per position for the tokens, then per layer one per (position, unit), the units being the
layer's neurons, or its features followed by its error (the error's column holds ``e . d a_t / d e``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._relp import relp_sites
from .._run import HookedRun, hook_site
from .._transformer_rules import Sites, register_rules
from ..dictionaries import Transcoder
from ..dictionaries.modules import Dictionary
from ..models import LMLayout, linear, logit_softcap
from ._attention import batched_attention
from ._math import merged_entries, top_entries


@dataclass
class Frozen:
    """The tensors of one frozen run: sources (leaves), targets (in the graph) and the clean logits."""

    layout: LMLayout
    dictionaries: dict[int, Dictionary] = field(default_factory=dict)  # layer -> its dictionary (else: neurons)
    tokens: torch.Tensor | None = None  # (1, T, d): the first layer's input, a leaf
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, units) leaf: held neurons/features
    targets: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, units) as computed
    errors: dict[int, torch.Tensor] = field(default_factory=dict)  # dictionary layer -> (1, T, d) leaf: held error
    mlp_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # neuron layer -> (1, T, d) the MLP's input
    branches: dict[int, list[tuple[nn.Module, torch.Tensor]]] = field(default_factory=dict)  # neuron layer -> (up
    # or gate projection, its output (1, T, units)), the pre-activations a neuron reads elementwise
    indirect: set[int] = field(default_factory=set)  # neuron layers whose projections do not read the MLP's input
    slopes: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # neuron layer -> d neurons / d branch
    final: torch.Tensor | None = None  # (1, T, d): the final norm's output
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (vocab,) at the last position
    runs: int = 0  # backward runs of the autograd engine
    batched: set[int] = field(default_factory=set)  # layers whose attention's backward is one product for all rows

    @property
    def n_layers(self) -> int:
        """Layers of the model."""
        return len(self.layout.layers)

    @property
    def positions(self) -> int:
        """Prompt length."""
        assert self.tokens is not None
        return int(self.tokens.shape[1])

    def units(self, layer: int) -> int:
        """Neurons or features of ``layer`` per position."""
        return int(self.leaves[layer].shape[-1])

    def per_position(self, layer: int) -> int:
        """Source columns of ``layer`` per position: its units, and its error after them (a dictionary's layer)."""
        return self.units(layer) + (layer in self.dictionaries)

    def column(self, layer: int) -> int:
        """The first source column of ``layer`` (tokens come first, one column per position)."""
        return self.positions * (1 + sum(self.per_position(i) for i in range(layer)))

    @property
    def n_columns(self) -> int:
        """Source columns: one per position, then one per (layer, position, unit or error)."""
        return self.column(self.n_layers)

    def locate(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(layer, position, unit)`` of source columns past the tokens (a dictionary's error: unit = its features)."""
        starts = torch.tensor([self.column(layer) for layer in range(self.n_layers)], dtype=torch.long)
        widths = torch.tensor([self.per_position(layer) for layer in range(self.n_layers)], dtype=torch.long)
        layer = torch.searchsorted(starts, columns, right=True) - 1
        rest = columns - starts[layer]
        return layer, rest // widths[layer], rest % widths[layer]

    def sources(self) -> torch.Tensor:
        """``(n_columns - positions,)`` each non-token source's activation (an error's: its norm)."""
        blocks = []
        for layer in range(self.n_layers):
            leaf = self.leaves[layer].detach()[0].cpu().double()
            if layer in self.errors:
                norm = self.errors[layer].detach()[0].cpu().double().norm(dim=-1)
                leaf = torch.cat([leaf, norm[:, None]], -1)
            blocks.append(leaf.flatten())
        return torch.cat(blocks)

    def is_error(self) -> torch.Tensor:
        """``(n_columns - positions,)`` true at the error columns."""
        blocks = []
        for layer in range(self.n_layers):
            block = torch.zeros(self.positions, self.per_position(layer), dtype=torch.bool)
            if layer in self.dictionaries:
                block[:, -1] = True
            blocks.append(block.flatten())
        return torch.cat(blocks)


def register(
    run: HookedRun, model: nn.Module, layout: LMLayout, rules: str | None, dictionaries: dict[int, Dictionary]
) -> Frozen:
    """Put the frozen model's hooks on ``run.group`` (see the module documentation); the run fills the result."""
    frozen = Frozen(layout, dict(dictionaries))
    group = run.group
    if rules == "relp":
        found = relp_sites(model, "relp", layout)
        assert found is not None
        register_rules(group, found)
    else:
        rms = [name for name, kind in layout.norms if kind == "rms"]
        register_rules(group, Sites(layout.embed, {}, [], [], rms, [n for n, k in layout.norms if k == "layer"]))
    _freeze_attention(group, layout)
    frozen.batched = batched_attention(group, model, layout)
    index, mlps, branches = {}, {}, {}
    for layer in layout.layers:
        if layer.index not in dictionaries:
            assert layer.mlp_parts is not None
            index[layer.mlp_parts.neurons] = layer.index
            mlps[layer.mlp] = layer.index
            parts = (layer.mlp_parts.gate, layer.mlp_parts.up)
            branches.update({name: layer.index for name in parts if name is not None})

    def tokens(x: torch.Tensor, name: str, call: int) -> torch.Tensor:
        frozen.tokens = run.leaf(x)
        return frozen.tokens

    def neurons(a: torch.Tensor, name: str, call: int) -> torch.Tensor:
        layer = index[name]
        frozen.targets[layer] = a
        frozen.leaves[layer] = a.detach().clone().requires_grad_(True)
        return frozen.leaves[layer]

    def mlp_input(x: torch.Tensor, name: str, call: int) -> None:
        frozen.mlp_inputs[mlps[name]] = x

    def branch(module: nn.Module, args: Any, z: torch.Tensor, *, name: str, call: int) -> None:
        layer = branches[name]
        frozen.branches.setdefault(layer, []).append((module, z))
        if not args or args[0] is not frozen.mlp_inputs.get(layer):  # the MLP changes its input first: no shortcut
            frozen.indirect.add(layer)

    def final(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        frozen.final = output

    hook_site(group, layout.layers[0].module, "input", None, tokens)
    if index:
        hook_site(group, list(mlps), "input", None, mlp_input)
        group.forward(list(branches), branch)
        hook_site(group, list(index), "input", None, neurons)
    if dictionaries:
        dictionary_hooks(group, frozen)
    group.forward(layout.final_norm, final)
    return frozen


def dictionary_hooks(group: HookGroup, frozen: Frozen) -> None:
    """The hooks at each MLP with a dictionary: features as targets, ``decode(held features) + held error`` written.

    An :class:`~attribution.SAE` encodes the MLP's output ``y`` (computed live, so a feature's own nonlinearity is
    the MLP's and then the encoder's); a :class:`~attribution.Transcoder` encodes the MLP's input ``x`` and adds its
    skip ``x @ W_skip`` live. The error is ``y - reconstruction`` at the clean point. The MLP's output keeps its value
    bitwise (``y.detach()`` plus terms that are zero), its gradient flowing to the two leaves. RelP's identity rule
    ``f / pre`` on the encoder's activation needs no hook: every activation of :mod:`attribution.dictionaries` is
    ``pre * mask`` (ReLU, TopK, JumpReLU, BatchTopK's threshold), whose ``f / pre`` is the mask, its gradient.
    """
    names = {frozen.layout.layers[layer].mlp: layer for layer in frozen.dictionaries}
    read: dict[int, torch.Tensor] = {}

    def remember(x: torch.Tensor, name: str, call: int) -> None:
        read[names[name]] = x

    def replace(y: torch.Tensor, name: str, call: int) -> torch.Tensor:
        layer = names[name]
        dictionary = frozen.dictionaries[layer]
        source = read.pop(layer) if isinstance(dictionary, Transcoder) else y
        source = source.to(device=dictionary.W_enc.device, dtype=dictionary.W_enc.dtype)
        f = dictionary.encode(source)
        frozen.targets[layer] = f
        held = f.detach().clone().requires_grad_(True)
        frozen.leaves[layer] = held
        skip = dictionary.skip_term(source) if isinstance(dictionary, Transcoder) else None
        written = dictionary.decode(held) + (0 if skip is None else skip)
        clean = written.detach().to(device=y.device, dtype=y.dtype)
        error = (y.detach() - clean).requires_grad_(True)
        frozen.errors[layer] = error
        change = (written - written.detach()).to(device=y.device, dtype=y.dtype)
        return y.detach() + change + (error - error.detach())

    transcoders = [name for name, layer in names.items() if isinstance(frozen.dictionaries[layer], Transcoder)]
    if transcoders:
        hook_site(group, transcoders, "input", None, remember)
    hook_site(group, list(names), "output", None, replace)


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


def neuron_slopes(frozen: Frozen) -> None:
    """Fill ``frozen.slopes``: each neuron's derivative by its own up (and gate) pre-activations, in one backward pass.

    A neuron reads its pre-activations elementwise (``act(gate) * up``, ``act(fc)``, also under RelP's rules), so a
    cotangent of ones gives every ``d a[p, i] / d z[p, i]`` at once. Layers whose projections do not read the MLP's
    input as it came (``frozen.indirect``) get none: their rows go in at the neurons.
    """
    layers = sorted(set(frozen.branches) - frozen.indirect)
    if not layers or frozen.slopes:
        return
    outputs = [frozen.targets[layer] for layer in layers]
    inputs = [z for layer in layers for _, z in frozen.branches[layer]]
    grads = iter(torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs], retain_graph=True,
                                     allow_unused=True))  # fmt: skip
    frozen.runs += 1
    for layer in layers:
        found = [next(grads) for _ in frozen.branches[layer]]
        frozen.slopes[layer] = [torch.zeros_like(z) if g is None else g for g, (_, z) in
                                zip(found, frozen.branches[layer], strict=True)]  # fmt: skip


def neuron_gradients(frozen: Frozen, layer: int, positions: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """``(n, d)``: each neuron's gradient by its MLP's input at its own position (the only one it reads)."""
    site = frozen.mlp_inputs[layer]
    total = site.new_zeros(len(units), site.shape[-1])
    for (module, _), slope in zip(frozen.branches[layer], frozen.slopes[layer], strict=True):
        w, _ = linear(module, device=site.device)
        total += slope[0, positions, units, None].to(site.dtype) * w[units.to(site.device)].to(site.dtype)
    return total


def node_rows(frozen: Frozen, targets: torch.Tensor, keep: int) -> Rows:
    """The rows of neuron or feature targets ``(rows, 3)`` (layer, position, unit), in one backward pass.

    A neuron's cotangent goes in at its MLP's input (:func:`neuron_gradients`), a feature's at the feature (and a
    neuron's at the neuron where its MLP changes its input before the projections).
    """
    layers = torch.unique(targets[:, 0]).tolist()
    outputs, cotangents = [], []
    rows = torch.arange(len(targets))
    neuron_slopes(frozen)
    for layer in layers:
        mine = targets[:, 0] == layer
        position, unit = targets[mine, 1], targets[mine, 2]
        if layer in frozen.slopes:
            output = frozen.mlp_inputs[layer]
            cotangent = output.new_zeros(len(targets), *output.shape)
            cotangent[rows[mine], 0, position] = neuron_gradients(frozen, layer, position, unit)
        else:
            output = frozen.targets[layer]
            cotangent = output.new_zeros(len(targets), *output.shape)
            cotangent[rows[mine], 0, position, unit] = 1
        outputs.append(output)
        cotangents.append(cotangent)
    return _rows(frozen, outputs, cotangents, max(layers), keep)


def logit_rows(frozen: Frozen, vectors: torch.Tensor, keep: int) -> Rows:
    """The rows of logit targets, given their vectors ``(rows, d)`` at the final norm's output (last position)."""
    assert frozen.final is not None
    cotangent = frozen.final.new_zeros(len(vectors), *frozen.final.shape)
    cotangent[:, 0, -1] = vectors.to(cotangent.dtype)
    return _rows(frozen, [frozen.final], [cotangent], frozen.n_layers, keep)


def _rows(frozen: Frozen, outputs: list[torch.Tensor], cotangents: list[torch.Tensor], below: int, keep: int) -> Rows:
    """One batched backward from ``outputs``; the products ``a_s * gradient`` at every source below layer ``below``.

    Each source's products are cut to every row's ``keep`` largest as its gradient arrives, inside the backward pass
    (a hook on the source, which hands autograd back a zero of no memory): no batch ever holds its rows' gradients of
    every source at once.
    """
    rows = len(cotangents[0])
    cut = torch.func.vmap(_cut_vjp(outputs, _sources(frozen, below), keep))(cotangents)  # one run of the engine
    frozen.runs += 1
    del cotangents[:]  # let them go before the merge
    blocks = [cut[name] for name in sorted(cut)]
    if not blocks:  # no source is reached: one zero entry per row
        assert frozen.tokens is not None
        blocks = [(torch.zeros(rows, 1, dtype=torch.long), frozen.tokens.new_zeros(rows, 1), torch.zeros(rows))]
    columns, values, sums = merged_entries(blocks, keep)
    return Rows(columns, values, sums)


def _sources(frozen: Frozen, below: int) -> list[tuple[torch.Tensor, Any]]:
    """Each source tensor below layer ``below`` with ``gradient -> (rows's block of products, first column, width)``."""
    assert frozen.tokens is not None
    tokens = frozen.tokens
    found: list[tuple[torch.Tensor, Any]] = [(tokens, lambda g: ((g * tokens).sum(-1)[0, :, None], 0, 1))]
    for layer in range(below):
        start, width, leaf = frozen.column(layer), frozen.per_position(layer), frozen.leaves[layer]
        found.append((leaf, lambda g, leaf=leaf, start=start, width=width: ((g * leaf)[0], start, width)))
        if layer in frozen.errors:
            held, units = frozen.errors[layer], frozen.units(layer)
            found.append((held, lambda g, held=held, start=start + units, width=width: (
                (g * held).sum(-1)[0, :, None], start, width)))  # fmt: skip
    return found


def _cut_vjp(outputs: list[torch.Tensor], sources: list[tuple[torch.Tensor, Any]], keep: int) -> Any:
    """``cotangents -> {source number: (columns, values, abs sum)}`` of each reached source's kept products."""

    def vjp(cotangents: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        cut: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def hook(number: int, products: Any, grad: torch.Tensor) -> torch.Tensor:
            block, start, width = products(grad)
            cut[number] = top_entries(block, start, width, keep)
            return grad.new_zeros(()).expand_as(grad)  # the gradient itself is not needed again

        handles = [t.register_hook(partial(hook, i, fn)) for i, (t, fn) in enumerate(sources)]
        try:
            torch.autograd.grad(outputs, [t for t, _ in sources], cotangents, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return cut

    return vjp
