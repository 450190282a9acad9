"""The three forwards of circuit discovery: record a run, take the readers' gradients, run with a circuit patched in.

Each is one :class:`attribution._run.HookedRun` (model state kept, one hook group, removed on errors and Ctrl-C).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._inputs import batch_size
from .._paired import checked_metric, take_rows
from .._run import HookedRun
from .._transformer_rules import Sites, register_rules
from ..patching.attribution import Tap
from ._math import head_writes, reader_inputs, split_readers, wide
from ._sites import head_weights, hook_graph, reader_slice, reader_weights
from .graph import Graph

Metric = Callable[[Any], torch.Tensor]


@dataclass
class Recorded:
    """One run's writer activations ``(writers, batch, tokens, d_model)`` and residual stream at each reader site."""

    writers: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    attn: list[torch.Tensor] = field(default_factory=list)  # per layer: the input of the attention norm
    mlp: list[torch.Tensor] = field(default_factory=list)  # per layer: the input of the MLP norm
    final: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # the input of the final norm
    metric: float = 0.0


class _Writers:
    """Fills a ``(writers, ...)`` buffer during a forward: the activations, or the activations minus ``base``.

    ``into`` is the buffer (``base`` itself: the deltas replace the base's rows in place); else one is made.
    """

    def __init__(
        self, model: nn.Module, graph: Graph, base: torch.Tensor | None = None, into: torch.Tensor | None = None
    ) -> None:
        self.graph = graph
        self.w_o = [head_weights(model, graph, i) for i in range(len(graph.layers))]
        self.base = base
        self.buffer = into if into is not None else torch.empty(0)

    def _put(self, index: slice | int, value: torch.Tensor) -> None:
        value = wide(value.detach())
        if self.buffer.numel() == 0:
            self.buffer = value.new_zeros(len(self.graph.writers), *value.shape[-3:])
        value = value.to(self.buffer.device)  # the layers may sit on several devices (device_map)
        self.buffer[index] = value if self.base is None else value - self.base[index]

    def embed(self, layer: int, x: torch.Tensor) -> None:
        self._put(0, x)

    def heads(self, layer: int, z: torch.Tensor) -> None:
        start = 1 + layer * (self.graph.n_heads + 1)
        w_o = self.w_o[layer].to(z.dtype)
        self._put(slice(start, start + self.graph.n_heads), head_writes(z.detach(), w_o, self.graph.n_heads))

    def mlp(self, layer: int, out: torch.Tensor) -> None:
        self._put((1 + layer) * (self.graph.n_heads + 1), out)


def record_run(model: nn.Module, graph: Graph, inputs: Any, metric: Metric) -> Recorded:
    """Run ``inputs`` without autograd; keep the writers, the residual stream at every reader, the metric."""
    found = Recorded()
    with HookedRun(model, "circuits-record") as run:
        writers = _Writers(model, graph)
        keep = lambda into: lambda layer, x: into.append(x.detach().clone())  # noqa: E731
        final: list[torch.Tensor] = []
        hook_graph(run.group, graph, embed=writers.embed, heads=writers.heads, mlp_output=writers.mlp,
                   attn_input=keep(found.attn), mlp_input=keep(found.mlp), final_input=keep(final))  # fmt: skip
        found.metric = float(checked_metric(metric, run.forward(inputs), False, batch_size(inputs)))
    found.writers, found.final = writers.buffer, final[0]
    return found


@dataclass
class Gradients:
    """What one gradient run gives.

    Per layer the attention norm's input and the attention readers' output gradients ``(readers, batch, tokens,
    d_head)``; per layer the MLP reader's gradient; the logits reader's gradient; the metric.
    """

    attn_x: list[torch.Tensor]
    attn: list[torch.Tensor]
    mlp: list[torch.Tensor]
    final: torch.Tensor
    metric: float


def gradient_run(
    model: nn.Module,
    graph: Graph,
    inputs: Any,
    metric: Metric,
    *,
    embed: torch.Tensor | None = None,
    deltas: torch.Tensor | None = None,
    rules: Sites | None = None,
) -> Gradients:
    """One forward with autograd from the first layer's input and one backward of ``metric``.

    ``embed`` replaces the first layer's input (an integrated-gradients point); with ``deltas`` (the corrupted
    writers), each row is replaced in place by this run's writer activation minus it (clean - corrupted). With
    ``rules`` (RelP's sites) the backward is RelP's: the rules' hooks go on first, the readers' taps after them.
    """
    attn_x: list[torch.Tensor] = []
    taps: dict[tuple[str, int, str], torch.Tensor] = {}

    with HookedRun(model, "circuits-gradients", with_grad=True) as run:

        def start(layer: int, x: torch.Tensor) -> torch.Tensor:
            if writers is not None:
                writers.embed(layer, x)
            return run.leaf(x.detach().clone() if embed is None else embed.to(x.dtype))

        def tap(key: tuple[str, int, str], x: torch.Tensor) -> torch.Tensor:
            """A copy of ``x`` whose gradient also reaches a leaf kept under ``key``."""
            taps[key] = x.detach().clone().requires_grad_(True)
            return Tap.apply(x, taps[key])

        def projection(layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
            return tap(("attn", layer, kind), x)

        def site(kind: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
            return lambda layer, x: tap((kind, layer, kind), x)

        if rules is not None:  # before the taps: a reader's gradient is the rules' from above it
            register_rules(run.group, rules)
        writers = _Writers(model, graph, deltas, into=deltas) if deltas is not None else None
        keep = lambda layer, x: attn_x.append(x.detach())  # noqa: E731
        hook_graph(run.group, graph, embed=start, attn_input=keep, projection=projection, mlp_input=site("mlp"),
                   final_input=site("final"), heads=writers.heads if writers else None,
                   mlp_output=writers.mlp if writers else None)  # fmt: skip
        value = checked_metric(metric, run.forward(inputs), False, batch_size(inputs))
        if not value.requires_grad:
            raise ValueError(
                "`metric` returned a tensor without a gradient: it does not depend on the model's output through "
                "differentiable operations (argmax, .item() or detach() cut the gradient; a constant metric has none)"
            )
        keys = list(taps)
        found = run.gradients(value, [taps[k] for k in keys], "the reader", [str(keys[0])])
    grads = {k: torch.zeros_like(taps[k]) if g is None else g for k, g in zip(keys, found, strict=True)}
    layers = range(len(graph.layers))
    order = ("q", "k", "v", "qkv")
    attn = [
        split_readers([grads["attn", i, kind] for kind in order if ("attn", i, kind) in grads], graph.d_head)
        for i in layers
    ]
    return Gradients(attn_x, attn, [grads["mlp", i, "mlp"] for i in layers],
                     grads["final", len(graph.layers), "final"], float(value.detach()))  # fmt: skip


def patched_run(
    model: nn.Module,
    graph: Graph,
    inputs: Any,
    metric: Metric,
    corrupted: Recorded,
    out: torch.Tensor,
) -> float:
    """The metric of ``inputs`` run with every edge of ``out`` ``(writers, readers)`` carrying its corrupted value.

    Each writer's delta (this run's activation minus the corrupted one) is taken during the run.
    """
    upstream = graph.upstream().tolist()
    per_layer = graph.attention_readers + 1
    mixed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # layer -> (reader inputs, W, b)

    with HookedRun(model, "circuits-patched") as run:
        writers = _Writers(model, graph, corrupted.writers)  # this run's deltas

        def delta() -> torch.Tensor:
            return writers.buffer

        def attn_input(layer: int, x: torch.Tensor) -> torch.Tensor | None:
            first = layer * per_layer
            rows = out[: upstream[first], first : first + graph.attention_readers].T
            if not rows.any():
                return None
            if rows.all():
                return corrupted.attn[layer].to(x.dtype)
            inputs_ = reader_inputs(x, corrupted.attn[layer], delta()[: upstream[first]], rows)
            weight, b = reader_weights(model, graph, layer)
            mixed[layer] = (inputs_, weight, b)
            return None

        def projection(layer: int, kind: str, output: torch.Tensor) -> torch.Tensor | None:
            if layer not in mixed:
                return None
            inputs_, weight, b = mixed[layer]
            readers = reader_slice(graph, kind)
            first = layer * per_layer
            changed = out[: upstream[first], first + readers.start : first + readers.stop].any(0)
            if not changed.any():
                return None
            norm = model.get_submodule(graph.layers[layer].attn_norm).forward  # not __call__: no hooks again
            rows = changed.nonzero().flatten() + readers.start
            projected = torch.einsum("rbtd,red->rbte", norm(inputs_[rows]), weight[rows].to(output.dtype))
            new = output.clone().unflatten(-1, (-1, graph.d_head))
            new[..., rows - readers.start, :] = (projected + b[rows, None, None].to(output.dtype)).movedim(0, -2)
            return new.flatten(-2)

        def single(which: str) -> Callable[[int, torch.Tensor], torch.Tensor | None]:
            def fn(layer: int, x: torch.Tensor) -> torch.Tensor | None:
                reader = layer * per_layer + graph.attention_readers if which == "mlp" else len(graph.readers) - 1
                row = out[: upstream[reader], reader][None]
                base = corrupted.mlp[layer] if which == "mlp" else corrupted.final
                return None if not row.any() else reader_inputs(x, base, delta()[: upstream[reader]], row)[0]

            return fn

        hook_graph(run.group, graph, attn_input=attn_input, projection=projection, mlp_input=single("mlp"),
                   final_input=single("final"), embed=writers.embed, heads=writers.heads,
                   mlp_output=writers.mlp)  # fmt: skip
        return float(checked_metric(metric, run.forward(inputs), False, batch_size(inputs)))


def edge_runs(
    model: nn.Module,
    graph: Graph,
    inputs: Any,
    metric: Metric,
    deltas: torch.Tensor,
    edges: list[tuple[int, int]],
    batch: int,
) -> list[float]:
    """The metric of each one-edge patched run, all in one forward of ``inputs`` (``len(edges)`` copies stacked).

    Copy ``c`` (rows ``c * batch`` to ``(c + 1) * batch``) is the clean run in which only reader ``edges[c][1]`` sees
    writer ``edges[c][0]``'s corrupted activation: its input minus that writer's delta ``deltas[w]`` (clean -
    corrupted). Up to that reader the copy is the clean run, so the residual stream there is the clean one.
    """
    per_layer = graph.attention_readers + 1
    by_reader: dict[int, list[tuple[int, int]]] = {}  # reader -> [(copy, writer)]
    for copy, (w, r) in enumerate(edges):
        by_reader.setdefault(r, []).append((copy, w))
    stream: dict[int, torch.Tensor] = {}

    with HookedRun(model, "circuits-edges") as run:

        def attn_input(layer: int, x: torch.Tensor) -> None:
            if any(layer * per_layer + i in by_reader for i in range(graph.attention_readers)):
                stream[layer] = x

        def projection(layer: int, kind: str, output: torch.Tensor) -> torch.Tensor | None:
            first, readers = layer * per_layer, reader_slice(graph, kind)
            chosen = [i for i in range(readers.start, readers.stop) if first + i in by_reader]
            if not chosen:
                return None
            weight, b = reader_weights(model, graph, layer)
            norm = model.get_submodule(graph.layers[layer].attn_norm).forward  # not __call__: no hooks again
            new = output.clone().unflatten(-1, (-1, graph.d_head))
            x = stream[layer]
            for i in chosen:
                copies = by_reader[first + i]
                rows = torch.cat([torch.arange(c * batch, (c + 1) * batch) for c, _ in copies])
                lowered = torch.cat(
                    [x[c * batch : (c + 1) * batch] - deltas[w].to(x.device, x.dtype) for c, w in copies]
                )
                projected = norm(lowered) @ weight[i].T.to(output.dtype)
                new[rows, :, i - readers.start] = projected + b[i].to(output.dtype)
            return new.flatten(-2)

        def single(which: str) -> Callable[[int, torch.Tensor], torch.Tensor | None]:
            def fn(layer: int, x: torch.Tensor) -> torch.Tensor | None:
                reader = layer * per_layer + graph.attention_readers if which == "mlp" else len(graph.readers) - 1
                if reader not in by_reader:
                    return None
                x = x.clone()
                for copy, w in by_reader[reader]:
                    x[copy * batch : (copy + 1) * batch] -= deltas[w].to(x.device, x.dtype)
                return x

            return fn

        hook_graph(run.group, graph, attn_input=attn_input, projection=projection, mlp_input=single("mlp"),
                   final_input=single("final"))  # fmt: skip
        output = run.forward(inputs)
    stacked = len(edges) * batch
    return [
        float(checked_metric(metric, take_rows(output, slice(c * batch, (c + 1) * batch), stacked), False, batch))
        for c in range(len(edges))
    ]
