"""``attribution_graph``: one prompt's graph of tokens, MLP neurons or dictionary features, and logits.

Cost: one forward kept with its graph, then one batched backward per ``batch_size`` rows (logit rows first, then
neuron and feature rows in order of their influence on the logits so far, circuit-tracer's strategy), each row cut to
its ``edges_per_row`` largest entries as it comes. Nothing of size (sources x sources) is ever held.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._inputs import token_ids
from .._progress import progress as progress_bar
from .._run import HookedRun
from ..dictionaries import SAE, Transcoder
from ..dictionaries.modules import Dictionary
from ..models import LMLayout, attention_visible, execution_device, linear, lm_layout
from ._frozen import Frozen, Rows, logit_rows, logit_vectors, node_rows, register
from ._math import partial_influence, salient_logits, sparse
from .graph import AttributionGraph, Nodes

Target = int | Sequence[int] | tuple[int, int] | Sequence[tuple[int, int]] | None
Rules = Literal["relp"] | None
Basis = Literal["neurons"] | Mapping[str | nn.Module, Dictionary]


def attribution_graph(
    model: nn.Module,
    inputs: Any,
    *,
    target: Target = None,
    basis: Basis = "neurons",
    rules: Rules = None,
    max_nodes: int | None = None,
    batch_size: int = 32,
    edges_per_row: int = 4096,
    progress: bool = True,
) -> AttributionGraph:
    """The attribution graph of one prompt: tokens, MLP neurons or dictionary features, logits, and direct effects.

    An edge ``s -> t`` is ``a_s * d a_t / d a_s`` in the frozen model of the prompt: attention probabilities and
    norm scales held at their clean values, every other node's activation held, the target's own nonlinearity
    differentiated at the clean point (``rules=None``) or through RelP's rules (``rules="relp"``: the identity rule
    ``act(x) / x`` and the half rule on a gated product). Neuron ``(layer, position, i)`` is the ``i``-th input of
    the MLP's down projection. With ``basis={mlp: dictionary}`` that MLP's neurons give way to the dictionary's
    features (targets and sources) and one error node per position (``MLP output - reconstruction``, a source
    only). See :doc:`/methods/graphs` (Ameisen et al. 2025, https://transformer-circuits.pub/
    2025/attribution-graphs/methods.html).

    Args:
        model: a HuggingFace decoder LM (or one :func:`attribution.models.lm_layout` reads) with a dense MLP.
        inputs: token ids ``(1, T)`` or ``(T,)``, or the model's keyword inputs with ``input_ids`` (one prompt).
        target: the logit nodes: ``None`` takes the most likely tokens until their probability sums to 0.95, at
            most 10; an int or a list of token ids; a ``(token, foil)`` tuple or a list of them (logit differences).
        basis: ``"neurons"``, or ``{mlp: dictionary}``: MLP modules of the model (their names, as in
            :func:`~attribution.splice`, or the modules) to an :class:`~attribution.SAE` trained on the MLP's output
            or a :class:`~attribution.Transcoder` from its input to its output; the other layers keep their neurons.
        rules: ``None`` (the gradient) or ``"relp"`` (a feature's encoder activation: the identity rule
            ``f / pre``).
        max_nodes: the neuron and feature nodes kept, the most influential first (``None``: every active one).
        batch_size: rows per backward pass.
        edges_per_row: the largest entries kept of each row (the rest are dropped as the row is computed).
        progress: show a progress bar on a terminal for long calls.

    Returns:
        The graph (nodes ordered: neurons and features by layer, errors, tokens, logits).

    Raises:
        ValueError: bad arguments, a model without a readable MLP, a ``basis`` key that is not one of its MLPs or a
            dictionary of another width, or a graph that would not fit in free memory.
        TypeError: a ``basis`` value that is not an SAE or a Transcoder.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=20, hidden_size=8, intermediate_size=12,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> graph = attribution_graph(model, torch.tensor([1, 2, 3]), target=4, progress=False)
        >>> len(graph.nodes), graph.nodes.kind[-1], graph.adjacency.shape   # 2 x 3 x 12 neurons, 3 tokens, 1 logit
        (76, 'logit', torch.Size([76, 76]))
    """
    layout = _checked(model, rules, batch_size, edges_per_row, max_nodes)
    dictionaries = _dictionaries(model, layout, basis)
    ids, model_inputs = _prompt(model, inputs)
    width = _width(model, layout)
    units = [dictionaries[i].n_features if i in dictionaries else width for i in range(len(layout.layers))]
    n_rows = _count(ids.shape[1], units, max_nodes)
    check_memory(layout, ids.shape[1], units, len(dictionaries), n_rows, batch_size, edges_per_row, _dtype(model),
                 max_nodes, execution_device(model.get_submodule(layout.embed)))  # fmt: skip
    with attention_visible(model), HookedRun(model, "attribution-graph", with_grad=True) as run:
        frozen = register(run, model, layout, rules, dictionaries)
        output = run.forward(model_inputs)
        frozen.logits = getattr(output, "logits", output)[0, -1].detach()
        tokens, foils, weights = logit_targets(target, frozen.logits.cpu())  # node data lives on the CPU
        store = _Store()
        vectors = logit_vectors(model, frozen, tokens, foils)
        for start in range(0, len(vectors), batch_size):
            chunk = vectors[start : start + batch_size]
            store.add(logit_rows(frozen, chunk, edges_per_row), -torch.ones(len(chunk), dtype=torch.long),
                      weights[start : start + batch_size], torch.full((len(chunk),), frozen.n_layers))  # fmt: skip
        visited = _visit(frozen, store, max_nodes, batch_size, edges_per_row, progress)
    return _assemble(frozen, store, visited, ids[0], tokens, foils, weights, rules, model_inputs, width)


def _checked(model: nn.Module, rules: Any, batch_size: int, edges_per_row: int, max_nodes: int | None) -> LMLayout:
    """The model's layout, after the arguments are checked."""
    if rules not in (None, "relp"):
        raise ValueError(f"`rules` must be None (the gradient) or 'relp' (RelP's rules); got {rules!r}")
    for name, value in (("batch_size", batch_size), ("edges_per_row", edges_per_row)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int; got {value!r}")
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 0):
        raise ValueError(f"`max_nodes` must be None or an int >= 0; got {max_nodes!r}")
    layout = lm_layout(model)
    for layer in layout.layers:
        if layer.mlp_parts is None or layer.parallel:
            what = "a parallel residual (attention and MLP read the same stream)" if layer.parallel else (
                f"no dense MLP in {layer.mlp!r} (looked for gate_proj/up_proj/down_proj or c_fc/c_proj, fc1/fc2; "
                "a mixture of experts has none)")  # fmt: skip
            raise ValueError(
                f"attribution graphs need a decoder whose MLP neurons feed the residual stream in sequence; "
                f"{type(model).__name__} has {what}"
            )
    if layout.unembed is None:
        raise ValueError(f"{type(model).__name__} has no unembedding (get_output_embeddings()): use a *ForCausalLM")
    return layout


def _dictionaries(model: nn.Module, layout: LMLayout, basis: Any) -> dict[int, Dictionary]:
    """``{layer: dictionary}`` from ``basis`` (empty for ``"neurons"``), each key an MLP and each width checked."""
    if isinstance(basis, str) and basis == "neurons":
        return {}
    if not isinstance(basis, Mapping):
        raise ValueError(
            "`basis` must be 'neurons' (MLP neurons: the down projection's inputs) or a mapping {MLP name: SAE or "
            f"Transcoder}}; got {basis!r}"
        )
    mlps = {layer.mlp: layer.index for layer in layout.layers}
    modules = {id(model.get_submodule(name)): name for name in mlps}
    found: dict[int, Dictionary] = {}
    for key, dictionary in basis.items():
        name = modules.get(id(key)) if isinstance(key, nn.Module) else key
        if name not in mlps:
            close = difflib.get_close_matches(str(key), list(mlps), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"`basis` key {key if isinstance(key, str) else type(key).__name__!r} is not an MLP of "
                f"{type(model).__name__}{hint}. A dictionary replaces the neurons of one of its MLPs: "
                f"{', '.join(repr(m) for m in mlps)}"
            )
        if not isinstance(dictionary, (SAE, Transcoder)):
            raise TypeError(
                f"`basis`[{name!r}] must be an SAE or a Transcoder; got {type(dictionary).__name__} (load one with "
                "attribution.load_dictionary)"
            )
        kind = type(dictionary).__name__
        sizes = (("d_in", dictionary.d_in, "input" if kind == "Transcoder" else "output"),
                 ("d_out", dictionary.d_out, "output"))  # fmt: skip
        for size, value, side in sizes:
            if value != layout.hidden:
                raise ValueError(
                    f"`basis`[{name!r}]: the {kind} has {size}={value}, but the MLP's {side} there has width "
                    f"{layout.hidden}: give the dictionary trained on this MLP"
                )
        layer = mlps[name]
        if layer in found:
            raise ValueError(f"`basis` names {name!r} twice: give one dictionary per MLP")
        found[layer] = dictionary
    return found


def _prompt(model: nn.Module, inputs: Any) -> tuple[torch.Tensor, Any]:
    """The token ids ``(1, T)`` and what the model is called with."""
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError(f"`inputs` must hold 'input_ids'; got keys {sorted(inputs)}")
        ids = token_ids(model, inputs["input_ids"], "inputs['input_ids']")
        model_inputs: Any = dict(inputs)
    else:
        ids = token_ids(model, inputs, "inputs")
        model_inputs = ids
    if ids.shape[0] != 1:
        raise ValueError(f"`inputs` must be one prompt (1, T); got {ids.shape[0]} prompts: make one graph per prompt")
    return ids, model_inputs


def _width(model: nn.Module, layout: LMLayout) -> int:
    """Neurons per layer: the down projection's input features."""
    down = model.get_submodule(layout.layers[0].mlp_parts.neurons)  # type: ignore[union-attr]
    w, _ = linear(down)  # (out, in), also for GPT-2's Conv1D
    return int(w.shape[1])


def _dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in (of its first floating parameter)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _count(positions: int, units: list[int], max_nodes: int | None) -> int:
    """The neuron and feature rows to compute, at most."""
    total = positions * sum(units)
    return total if max_nodes is None else min(max_nodes, total)


def logit_targets(target: Target, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logit nodes' tokens, foils (``-1``: none) and weights for the influence.

    ``None``: circuit-tracer's salient logits and their probabilities; token ids: their probabilities; pairs:
    equal weights ``1 / pairs``.

    Example:
        >>> logit_targets([(3, 1)], torch.zeros(5))
        (tensor([3]), tensor([1]), tensor([1.], dtype=torch.float64))
    """
    vocab = logits.shape[-1]
    if target is None:
        ids, probs = salient_logits(logits)
        return ids, torch.full_like(ids, -1), probs
    many = isinstance(target, Sequence) and not isinstance(target, tuple)
    pairs: list[Any] = list(target) if many else [target]  # type: ignore[arg-type]
    if pairs and all(isinstance(t, tuple) and len(t) == 2 for t in pairs):
        tokens, foils = torch.tensor([int(t[0]) for t in pairs]), torch.tensor([int(t[1]) for t in pairs])
    elif pairs and all(isinstance(t, int) and not isinstance(t, bool) for t in pairs):
        tokens, foils = torch.tensor(pairs), torch.full((len(pairs),), -1)
    else:
        raise TypeError(
            f"`target` must be None, a token id, a list of token ids, a (token, foil) tuple or a list of them; got "
            f"{target!r}"
        )
    bad = [int(t) for t in torch.cat([tokens, foils[foils >= 0]]) if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"`target` holds token ids outside the vocabulary [0, {vocab}): {bad}")
    if bool((foils >= 0).any()):
        return tokens, foils, torch.full((len(tokens),), 1 / len(tokens), dtype=torch.float64)
    return tokens, foils, torch.softmax(logits.double(), -1)[tokens]


@dataclass
class _Store:
    """The rows computed so far: kept entries, the node each row belongs to, the logit weights, rows by layer."""

    rows: list[Rows] = field(default_factory=list)  # per batch, its rows sorted by layer
    nodes: list[torch.Tensor] = field(default_factory=list)  # per batch: source column of each row's node, -1: logit
    starts: list[torch.Tensor] = field(default_factory=list)
    groups: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # layer -> (batch, first row
    # in the batch, end, first row in the store) of each run of rows of that layer
    count: int = 0

    def add(self, rows: Rows, nodes: torch.Tensor, starts: torch.Tensor, layers: torch.Tensor) -> None:
        """Keep a batch of rows (each row's layer: ``layers``)."""
        order = torch.argsort(layers, stable=True)  # logit rows share a layer: they keep their order
        batch = len(self.rows)
        self.rows.append(Rows(rows.columns[order].cpu(), rows.values[order].detach().cpu(),
                              rows.abs_sums[order].detach().cpu()))  # fmt: skip
        self.nodes.append(nodes[order])
        self.starts.append(starts[order].to(torch.float64))
        values, counts = torch.unique_consecutive(layers[order], return_counts=True)
        begin = 0
        for layer, n in zip(values.tolist(), counts.tolist(), strict=True):
            self.groups.setdefault(layer, []).append((batch, begin, begin + n, self.count + begin))
            begin += n
        self.count += len(order)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(row, column, value)`` of every kept entry, rows numbered in the order they are kept."""
        rows, offset = [], 0
        for block in self.rows:
            rows.append(torch.arange(offset, offset + len(block.columns)).repeat_interleave(block.columns.shape[1]))
            offset += len(block.columns)
        columns = torch.cat([r.columns.flatten() for r in self.rows])
        values = torch.cat([r.values.flatten() for r in self.rows])
        return torch.cat(rows), columns, values

    def influence(self, n_columns: int) -> torch.Tensor:
        """Each source column's influence on the logits through the rows so far (circuit-tracer's partial one)."""

        def groups() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
            for layer in sorted(self.groups, reverse=True):
                for batch, begin, end, first in self.groups[layer]:
                    block = self.rows[batch]
                    sums = block.abs_sums[begin:end, None].double().clamp_min(1e-8)
                    weights = block.values[begin:end].abs() / sums
                    yield torch.arange(first, first + end - begin), block.columns[begin:end], weights

        return partial_influence(groups(), torch.cat(self.nodes), torch.cat(self.starts), n_columns)


def _visit(
    frozen: Frozen, store: _Store, max_nodes: int | None, batch_size: int, keep: int, progress: bool
) -> torch.Tensor:
    """Compute neuron and feature rows, the most influential unvisited active one first; their source columns."""
    active = (frozen.sources() != 0) & ~frozen.is_error()  # errors: sources only, never visited
    n_active = int(active.sum())
    count = n_active if max_nodes is None else min(max_nodes, n_active)
    in_order = count == n_active
    pending_all = active.nonzero().flatten()
    visited = torch.zeros_like(active)
    done = 0
    steps = math.ceil(count / batch_size)
    for _ in progress_bar(range(steps), desc="attribution graph rows", enabled=progress):
        size = min(batch_size, count - done)
        if in_order:
            pending = pending_all[done : done + size]
        else:
            score = store.influence(frozen.n_columns)[frozen.positions :]
            pending = torch.topk(score.masked_fill(~active | visited, -1.0), size).indices
        layer, position, unit = frozen.locate(pending + frozen.positions)
        triples = torch.stack([layer, position, unit], 1)
        store.add(node_rows(frozen, triples, keep), pending + frozen.positions, torch.zeros(size), layer)
        visited[pending] = True
        done += size
    return visited.nonzero().flatten() + frozen.positions


def _assemble(
    frozen: Frozen, store: _Store, visited: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor,
    foils: torch.Tensor, weights: torch.Tensor, rules: Rules, inputs: Any, width: int,
) -> AttributionGraph:  # fmt: skip
    """The graph: nodes [visited neurons and features, errors, tokens, logits], the kept entries as a sparse matrix."""
    t = frozen.positions
    errors = frozen.is_error().nonzero().flatten() + t
    inner = torch.cat([visited, errors])  # source columns of the nodes before the tokens, in node order
    n_inner = len(inner)
    n = n_inner + t + len(tokens)
    row_nodes = torch.cat(store.nodes)  # source column of each row's node, -1 for logits in their order
    logit_number = torch.cumsum(row_nodes < 0, 0) - 1
    rows, columns, values = store.entries()
    target = torch.where(row_nodes < 0, n_inner + t + logit_number, _node_of(row_nodes, inner, t))[rows]
    source = _node_of(columns, inner, t)
    ok = (source >= 0) & (values != 0)
    adjacency = sparse(torch.stack([target[ok], source[ok]]), values[ok], (n, n))
    layer, position, unit = frozen.locate(inner)
    dictionary = torch.tensor([i in frozen.dictionaries for i in range(frozen.n_layers)], dtype=torch.bool)
    error = torch.zeros(n_inner, dtype=torch.bool)
    error[len(visited) :] = True
    kinds = tuple("error" if e else "feature" if d else "neuron" for e, d in zip(error.tolist(),
                  dictionary[layer].tolist(), strict=True))  # fmt: skip
    logit_values = _logit_values(frozen.logits, tokens, foils)
    assert frozen.tokens is not None
    embeddings = frozen.tokens.detach()[0].double().norm(dim=-1).cpu()
    nodes = Nodes(
        kind=kinds + ("token",) * t + ("logit",) * len(tokens),
        layer=torch.cat([layer, torch.full((t,), -1), torch.full((len(tokens),), frozen.n_layers)]),
        position=torch.cat([position, torch.arange(t), torch.full((len(tokens),), t - 1)]),
        index=torch.cat([torch.where(error, -1, unit), ids.cpu(), tokens]),
        activation=torch.cat([frozen.sources()[inner - t], embeddings, logit_values]),
        influence=torch.zeros(n, dtype=torch.float64),
    )
    units = tuple(frozen.units(i) for i in range(frozen.n_layers))
    graph = AttributionGraph(nodes, adjacency, ids.cpu(), weights, foils, frozen.n_layers, width, rules, inputs,
                             frozen.runs, units=units, basis=_names(frozen))  # fmt: skip
    return graph.with_influence()


def _names(frozen: Frozen) -> dict[str, Dictionary]:
    """``{MLP name: dictionary}`` of the layers with a dictionary."""
    return {frozen.layout.layers[layer].mlp: d for layer, d in sorted(frozen.dictionaries.items())}


def _node_of(columns: torch.Tensor, inner: torch.Tensor, positions: int) -> torch.Tensor:
    """The node number of each source column (tokens after the ``inner`` nodes), ``-1`` where it is no node.

    ``inner``: the source column of each node before the tokens, in node order.
    """
    if not len(inner):
        return torch.where(columns < positions, columns, -1)
    ordered, order = torch.sort(inner)
    where = torch.searchsorted(ordered, columns).clamp_max(len(ordered) - 1)
    found = ordered[where] == columns
    return torch.where(columns < positions, len(inner) + columns, torch.where(found, order[where], -1))


def _logit_values(logits: torch.Tensor, tokens: torch.Tensor, foils: torch.Tensor) -> torch.Tensor:
    """Each logit node's value: its logit minus the mean logit, or minus its foil's logit."""
    z = logits.double().cpu()
    return torch.where(foils >= 0, z[tokens] - z[foils.clamp_min(0)], z[tokens] - z.mean())


OVERHEAD = 2**30
"""Bytes a graph's process needs beside its tensors (the autograd engine's and the allocator's own; measured on
SmolLM2-135M: 0.5-0.9 GiB above the tensors at 16-64 tokens)."""


def memory_estimate(
    layout: LMLayout, positions: int, units: list[int], errors: int, rows: int, batch_size: int, keep: int,
    dtype: torch.dtype,
) -> tuple[int, int, int]:  # fmt: skip
    """``(per batch, kept rows, held by the forward)`` in bytes: what a graph needs at most, a little over.

    ``units``: the neurons or features of each layer; ``errors``: the layers with a dictionary (an error each). A
    batch holds one source's block of products three times (the sources' gradients are cut to their kept entries
    as they arrive, never all held), the cotangents, a margin of one layer's attention probabilities per row, and
    the residual stream's gradients; the forward holds its activations and every layer's attention probabilities,
    and the process about :data:`OVERHEAD` more. An upper bound: on SmolLM2-135M at 1,024 tokens it gives 13.7 GiB
    for 1,000 kept rows, where a batch of 32 rows was measured at 7.0 GiB.
    """
    size = torch.finfo(dtype).bits // 8
    layers, total, hidden, heads = len(units), sum(units), layout.hidden, layout.n_heads
    columns = positions * (1 + total + errors)
    widest = positions * (max(units) + 1)
    cotangents = layers * positions * max(hidden, max(units))
    batch = batch_size * (3 * widest + cotangents + heads * positions**2 + 8 * positions * hidden) * size
    kept = (rows + 10) * min(keep, columns) * (16 + size) * 3 + columns * 8 * 4
    held = positions * (12 * hidden * (layers + errors) + 6 * total) * size + layers * heads * positions**2 * size
    return batch, kept, held + OVERHEAD


def check_memory(
    layout: LMLayout, positions: int, units: list[int], errors: int, rows: int, batch_size: int, keep: int,
    dtype: torch.dtype, max_nodes: int | None, device: torch.device | None = None,
) -> None:  # fmt: skip
    """Refuse, before any work, a graph whose :func:`memory_estimate` exceeds the free memory (when it can be read)."""
    batch, kept, held = memory_estimate(layout, positions, units, errors, rows, batch_size, keep, dtype)
    needed = batch + kept + held
    free = free_memory(device)
    if free is not None and needed > free:
        raise ValueError(
            f"the graph needs about {needed / 2**30:.1f} GiB ({batch / 2**30:.1f} GiB per batch of {batch_size} rows, "
            f"{kept / 2**30:.1f} GiB for the {rows} kept rows of up to {keep} edges) but {free / 2**30:.1f} GiB is "
            f"free: lower `max_nodes` (now {max_nodes}), `batch_size` (now {batch_size}) or `edges_per_row` "
            f"(now {keep})"
        )


def free_memory(device: torch.device | None = None) -> int | None:
    """Free bytes: the GPU's for a CUDA device, else the system's available memory (Linux), else ``None``."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
