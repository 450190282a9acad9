"""How much of a behaviour a circuit carries: the clean run with every edge outside the circuit corrupted.

In the patched run, each reader's input is the run's residual stream at the reader minus, over the writers upstream
of it whose edge to it is outside the circuit, ``(the writer's activation in this run - its corrupted activation)``.
The full circuit is the clean run and the empty one the corrupted run (both exactly: a reader with no edge outside
reads the run's residual stream itself, one with none inside the corrupted run's). Faithfulness is
``(evaluate - metric(corrupted)) / (metric(clean) - metric(corrupted))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Literal

import torch
from torch import nn

from hooks import hooked_modules

from .._inputs import batch_size
from .._paired import check_same_shapes, plain, repeat_batch
from .._progress import progress as progress_bar
from .._replay import replaying
from .._run import HookedRun, eager_module
from ._runs import edge_runs, patched_run, record_run
from .circuit import Circuit
from .edges import EdgeScores
from .graph import Graph, read_graph

Metric = Callable[[Any], torch.Tensor]


def _prepared(model: nn.Module, clean: Any, corrupted: Any, names: Mapping[str, Any] | None) -> tuple[Any, ...]:
    model = eager_module(model)
    clean, corrupted = plain(clean, model), plain(corrupted, model)
    check_same_shapes(clean, corrupted)
    return model, clean, corrupted, read_graph(model, **(names or {}))


def _outside(graph: Graph, circuit: Circuit) -> torch.Tensor:
    """``(writers, readers)`` boolean: the edges of the graph that are not in ``circuit`` (checked against it)."""
    if not isinstance(circuit, Circuit):
        raise TypeError(f"`circuit` must be a Circuit (e.g. scores.top(100)); got {type(circuit).__name__}")
    w, r = graph.edge_indices(circuit)
    out = graph.edge_mask()
    out[w, r] = False
    return out


def _frozen(model: nn.Module) -> None:
    for p in model.parameters():  # no parameter gradients; restored by the enclosing HookedRun
        p.requires_grad_(False)


def evaluate(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    circuit: Circuit,
    *,
    names: Mapping[str, Any] | None = None,
) -> float:
    """The metric of the clean run in which only the edges of ``circuit`` carry clean values (see the module docs).

    Args:
        model: a causal language model (see :func:`attribution.edge_attribution`).
        clean: the clean inputs.
        corrupted: the corrupted inputs, same structure and shapes.
        metric: ``metric(model_output) -> scalar tensor``.
        circuit: the edges kept.
        names: module names and sizes for a layout :func:`~attribution.circuits.read_graph` does not find by itself
            (its keyword arguments).

    Returns:
        The metric of the patched run: ``metric(clean)`` for the full circuit, ``metric(corrupted)`` for the empty one.

    Raises:
        KeyError: ``circuit`` names nodes that are not in the model's graph (all of them are listed).
        ValueError: a pair of ``circuit`` that is not an edge; inputs of different shapes.

    Example:
        >>> import transformers
        >>> from attribution.circuits import Circuit
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda out: out.logits[0, -1, 2]
        >>> empty = evaluate(model, clean, corrupted, metric, Circuit(edges=[]))
        >>> empty == float(metric(model(corrupted)).detach())
        True
    """
    model, clean, corrupted, graph = _prepared(model, clean, corrupted, names)
    out = _outside(graph, circuit)
    with HookedRun(model, "circuits"):
        _frozen(model)
        low = record_run(model, graph, corrupted, metric)
        return patched_run(model, graph, clean, metric, low, out)


def faithfulness(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    circuits: Circuit | Sequence[Circuit],
    *,
    progress: bool = False,
    names: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """``(evaluate - metric(corrupted)) / (metric(clean) - metric(corrupted))`` of one circuit or of several.

    The corrupted and clean runs are shared by all circuits: one more forward per circuit.

    Returns:
        A float64 tensor: a scalar for one circuit, ``(circuits,)`` for a sequence.

    Example:
        >>> import transformers
        >>> from attribution.circuits import Circuit, edge_attribution
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda out: out.logits[0, -1, 2]
        >>> full = edge_attribution(model, clean, corrupted, metric, progress=False).top(100)
        >>> faithfulness(model, clean, corrupted, metric, [Circuit(edges=[]), full]).tolist()
        [0.0, 1.0]
    """
    model, clean, corrupted, graph = _prepared(model, clean, corrupted, names)
    single = isinstance(circuits, Circuit)
    chosen = [circuits] if isinstance(circuits, Circuit) else list(circuits)
    outs = [_outside(graph, c) for c in chosen]
    with HookedRun(model, "circuits") as run:
        _frozen(model)
        low = record_run(model, graph, corrupted, metric)
        high = float(metric(run.forward(clean)))
        values = [
            patched_run(model, graph, clean, metric, low, out)
            for out in progress_bar(outs, desc="circuits", enabled=progress)
        ]
    if high == low.metric:
        raise ValueError(
            f"`metric` is {high} on both the clean and the corrupted inputs: faithfulness divides by their "
            "difference. Choose inputs that differ in the behaviour the metric measures"
        )
    result = (torch.tensor(values, dtype=torch.float64) - low.metric) / (high - low.metric) + 0.0  # no -0.0
    return result[0] if single else result


def faithfulness_curve(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    scores: EdgeScores,
    budgets: Iterable[int],
    *,
    progress: bool = False,
    names: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Faithfulness of the top-``n`` circuit of ``scores`` for each ``n`` of ``budgets``: ``(budgets,)`` float64.

    Example:
        >>> import transformers
        >>> from attribution.circuits import edge_attribution
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda out: out.logits[0, -1, 2]
        >>> scores = edge_attribution(model, clean, corrupted, metric, progress=False)
        >>> faithfulness_curve(model, clean, corrupted, metric, scores, [0, 1000]).tolist()
        [0.0, 1.0]
    """
    ranked = scores.edges()
    circuits = [Circuit(edges=[(w, r) for w, r, _ in ranked[: max(int(n), 0)]]) for n in budgets]
    return faithfulness(model, clean, corrupted, metric, circuits, progress=progress, names=names)


def exact_edge_effects(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    edges: Iterable[tuple[str, str]],
    *,
    edges_per_run: int = 8,
    progress: bool = True,
    names: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """What each EAP score estimates, exactly: ``metric(clean with only that edge corrupted) - metric(clean)``.

    One patched run per edge, in which only the edge's reader sees the writer's corrupted activation (every other
    edge keeps its clean value). ``edges_per_run`` of them go in one forward, the clean batch stacked once per edge,
    in the order of their readers; the module calls that finish before the first reader of a forward are replayed
    from the clean run instead of recomputed, where that cannot be told apart from running them (see
    ``attribution._replay``).

    Args:
        model: a causal language model (see :func:`attribution.edge_attribution`).
        clean: the clean inputs.
        corrupted: the corrupted inputs, same structure and shapes.
        metric: ``metric(model_output) -> scalar tensor``, called on each patched run's rows.
        edges: ``(writer, reader)`` pairs.
        edges_per_run: how many edges share a forward (memory grows with it: that many copies of the batch).
        progress: a progress bar on a terminal over the forwards.
        names: module names and sizes for a layout :func:`~attribution.circuits.read_graph` does not find by itself.

    Returns:
        A float64 tensor ``(edges,)``, in the order of ``edges``.

    Raises:
        KeyError: ``edges`` names nodes that are not in the model's graph.
        ValueError: a pair that is not an edge; ``edges_per_run`` not a positive int; inputs of different shapes.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda out: out.logits[0, -1, 2]
        >>> exact_edge_effects(model, clean, corrupted, metric, [("embed", "a0.h0.q")], progress=False).shape
        torch.Size([1])
    """
    if isinstance(edges_per_run, bool) or not isinstance(edges_per_run, int) or edges_per_run < 1:
        raise ValueError(f"`edges_per_run` must be an int of at least 1; got {edges_per_run!r}")
    hooked = {id(m) for m in hooked_modules(model)}
    model, clean, corrupted, graph = _prepared(model, clean, corrupted, names)
    w, r = graph.edge_indices(list(edges), "`edges`")
    order = sorted(range(len(w)), key=lambda i: (r[i], w[i]))  # by reader: the forward's first reader comes first
    chunks = [order[i : i + edges_per_run] for i in range(0, len(order), edges_per_run)]
    batch = batch_size(clean)
    values = torch.empty(len(w), dtype=torch.float64)
    with HookedRun(model, "circuits") as run, ExitStack() as stack:
        _frozen(model)
        low = record_run(model, graph, corrupted, metric)
        high = record_run(model, graph, clean, metric)
        deltas = high.writers - low.writers
        sites = [_reader_site(graph, r[chunk[0]]) for chunk in chunks]
        _, plans, replay = stack.enter_context(replaying(model, run.forward, clean, sites, hooked))
        for n, chunk in enumerate(progress_bar(chunks, desc="exact edges", enabled=progress)):
            if replay is not None and plans is not None:
                replay.use({key: repeat_batch(out, len(chunk), batch) for key, out in plans[n].items()})
            stacked = repeat_batch(clean, len(chunk), batch)
            found = edge_runs(model, graph, stacked, metric, deltas, [(w[i], r[i]) for i in chunk], batch)
            values[chunk] = torch.tensor(found, dtype=torch.float64) - high.metric
    return values


def _reader_site(graph: Graph, reader: int) -> tuple[str, Literal["input"]]:
    """The module whose input a reader reads: its layer's attention norm or MLP norm, or the final norm."""
    layer, kind = divmod(reader, graph.attention_readers + 1)
    if layer == len(graph.layers):
        return graph.final_norm, "input"
    spec = graph.layers[layer]
    return (spec.mlp_norm if kind == graph.attention_readers else spec.attn_norm), "input"
