"""Edge attribution patching (EAP) and its integrated-gradients form (EAP-IG): every edge of a transformer scored.

EAP (`Syed et al. 2023 <https://arxiv.org/abs/2310.10348>`_) estimates, for every edge ``(w, r)`` of the graph of
:mod:`attribution.circuits.graph`, what the metric would gain if reader ``r`` saw writer ``w``'s corrupted
activation instead of its clean one, to first order:

``score(w, r) = sum over batch and positions of (a_w(corrupted) - a_w(clean)) . g_r``

where ``g_r`` is the gradient of the metric with respect to the residual stream as read by ``r`` alone (through its
own slice of the q/k/v projection and the attention norm, through the MLP's norm, or through the final norm for
``logits``). EAP-IG (`Hanna et al. 2024 <https://arxiv.org/abs/2403.17806>`_, "inputs" variant) averages ``g_r``
over ``k`` runs whose first-layer input is ``embed(corrupted) + i/k (embed(clean) - embed(corrupted))``,
``i = 1 .. k`` (``i = k`` is the clean run); the writer differences always come from the clean and corrupted runs.

With ``rules="relp"`` ``g_r`` is RelP's (`Jafari et al. 2025 <https://arxiv.org/abs/2508.21258>`_): the backward of
the same forward through LRP's rules (norm scales held constant, the identity rule on the MLP activation, the half
rule on a gated MLP's product; see :mod:`attribution._relp`), at the same cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._paired import check_same_shapes, plain
from .._progress import progress as progress_bar
from .._relp import Rules, relp_sites
from .._run import HookedRun, eager_module, warn
from .._transformer_rules import Sites, norm_rule
from ..models import LMLayout, lm_layout
from ._math import norm_vjp, wide
from ._runs import Gradients, gradient_run, record_run
from ._sites import reader_weights
from .circuit import Circuit
from .graph import Graph, read_graph


@dataclass
class EdgeScores:
    """The scores of every edge: ``scores[writer, reader]``, NaN where ``(writer, reader)`` is not an edge.

    ``clean_metric`` and ``corrupted_metric`` are the metric of the two runs; a score is the estimated change of the
    clean run's metric when that one edge carries the corrupted value (negative: the edge carries the behaviour).
    """

    writers: list[str]
    readers: list[str]
    scores: torch.Tensor
    clean_metric: float
    corrupted_metric: float
    ig_steps: int = 1
    rules: Rules = "gradient"

    def edges(self, n: int | None = None) -> list[tuple[str, str, float]]:
        """``(writer, reader, score)`` of the ``n`` edges of largest ``|score|`` (all edges by default), largest first.

        Ties are broken by graph order (writer, then reader).
        """
        flat = self.scores.flatten()
        valid = (~flat.isnan()).nonzero().flatten()
        order = valid[torch.argsort(flat[valid].abs(), descending=True, stable=True)]
        if n is not None:
            order = order[: max(int(n), 0)]
        width = len(self.readers)
        return [(self.writers[i // width], self.readers[i % width], float(flat[i])) for i in order.tolist()]

    def top(self, n: int) -> Circuit:
        """The circuit of the ``n`` edges of largest ``|score|``."""
        return Circuit(edges=[(w, r) for w, r, _ in self.edges(n)])

    def to_dataframe(self) -> Any:
        """A ``pandas.DataFrame`` with columns ``writer``, ``reader``, ``score``, one row per edge, largest first."""
        import pandas as pd

        return pd.DataFrame(self.edges(), columns=["writer", "reader", "score"])

    def plot(self, n: int = 100, *, ax: Any = None, title: str | None = None) -> Any:
        """Draw the ``n``-edge circuit of largest ``|score|`` (see :func:`attribution.circuits.plot_circuit`)."""
        from .plot import plot_circuit

        return plot_circuit(self, n, ax=ax, title=title)


def edge_attribution(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Callable[[Any], torch.Tensor],
    *,
    ig_steps: int = 1,
    progress: bool = True,
    names: Mapping[str, Any] | None = None,
    rules: Rules = "gradient",
    layout: LMLayout | None = None,
) -> EdgeScores:
    """Score every edge of a decoder-only transformer with EAP (``ig_steps=1``) or EAP-IG (see the module docs).

    All edges come from one corrupted forward, one clean forward with its backward, and ``ig_steps - 1`` more
    forwards and backwards at the integrated-gradients points; every example of the batch in each. The readers'
    gradients ``(readers, batch, tokens, d_model)`` are contracted with the deltas of the writers upstream of them in
    one matrix product per layer: for EAP as soon as a layer's are known (the scores' own buffers are the writers'
    deltas plus one layer's readers), for EAP-IG once, after summing them over the points (the deltas plus every
    reader's gradient: linear in the batch and in the number of nodes, never in the number of edges).

    Args:
        model: a HuggingFace-style causal language model (Llama, Qwen2, Mistral, Gemma, SmolLM2 or GPT-2 layout; see
            :func:`attribution.circuits.read_graph` for others).
        clean: the clean inputs: token ids ``(batch, tokens)``, or the model's usual inputs (a dict).
        corrupted: the corrupted inputs, same structure and shapes.
        metric: ``metric(model_output) -> scalar tensor`` (e.g. the mean logit difference), differentiable in the
            output.
        ig_steps: 1 for EAP; ``k > 1`` for EAP-IG with ``k`` points.
        progress: a progress bar on a terminal over the integrated-gradients runs.
        names: module names and sizes for a layout :func:`~attribution.circuits.read_graph` does not find by itself
            (its keyword arguments).
        rules: ``"gradient"`` (EAP, EAP-IG) or ``"relp"`` (the readers' gradients from RelP's rules; HuggingFace
            Llama-style or GPT-2 models).
        layout: the model's :func:`attribution.models.lm_layout`, instead of ``names`` (the same keywords in every
            family).

    Returns:
        The :class:`EdgeScores` (float32 or wider, on the CPU).

    Raises:
        ValueError: ``ig_steps`` not a positive int, ``clean`` and ``corrupted`` of different shapes, ``metric`` not a
            scalar or not depending on the output, an unknown layout, a bad ``rules``.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=2, n_head=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda out: out.logits[0, -1, 2] - out.logits[0, -1, 5]
        >>> scores = edge_attribution(model, clean, corrupted, metric, progress=False)
        >>> scores.scores.shape, len(scores.top(10))
        (torch.Size([7, 15]), 10)
    """
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"`ig_steps` must be an int of at least 1 (1: EAP); got {ig_steps!r}")
    model = eager_module(model)
    layout = layout or lm_layout(model, **(names or {}))  # the one read of the model's structure
    where = relp_sites(model, rules, layout)
    clean, corrupted = plain(clean, model), plain(corrupted, model)
    check_same_shapes(clean, corrupted)
    graph = read_graph(model, layout)
    with HookedRun(model, "circuits"):  # one saved state for the whole call; each run keeps its own too
        for p in model.parameters():
            p.requires_grad_(False)
        low = record_run(model, graph, corrupted, metric)
        deltas = low.writers  # becomes clean - corrupted during the clean run
        start = low.writers[0].clone()
        total = torch.zeros(len(graph.writers), len(graph.readers), dtype=deltas.dtype)
        grads = gradient_run(model, graph, clean, metric, deltas=deltas, rules=where)
        high = grads.metric
        if ig_steps == 1:  # contracted layer by layer: one layer's readers in memory at a time
            for first, upstream, readers in _reader_gradients(model, graph, grads, where):
                _contract(total, deltas, readers, first, upstream)
        else:  # the readers' gradients summed over the points first, then contracted once
            summed = list(_reader_gradients(model, graph, grads, where))
            for i in progress_bar(range(1, ig_steps), desc="EAP-IG", enabled=progress):
                point = start + i / ig_steps * deltas[0]
                run = gradient_run(model, graph, clean, metric, embed=point, rules=where)
                found = _reader_gradients(model, graph, run, where)
                for (*_, into), (*_, readers) in zip(summed, found, strict=True):
                    into += readers
            for first, upstream, readers in summed:
                _contract(total, deltas, readers, first, upstream)
    scores = torch.where(graph.edge_mask(), -total / ig_steps, torch.nan)
    finite = scores[graph.edge_mask()]
    if not finite.isfinite().all():
        warn("some edge scores are NaN or infinite: the model's activations or the metric's gradient overflowed; "
             "run the model in float32 (model.float()) or check the metric")  # fmt: skip
    elif not finite.any():
        warn("every edge score is 0: `clean` and `corrupted` give the same writer activations or the metric does "
             "not change with them; choose inputs that differ in the behaviour the metric measures")  # fmt: skip
    return EdgeScores(graph.writers, graph.readers, scores, high, low.metric, ig_steps, rules)


ReaderGradients = tuple[int, list[int], torch.Tensor]


def _reader_gradients(
    model: nn.Module, graph: Graph, grads: Gradients, rules: Sites | None = None
) -> Iterator[ReaderGradients]:
    """Per layer, then for ``logits``: (first reader, upstream counts, gradients ``(readers, batch, tokens, d)``).

    The attention readers' gradients are taken through the attention norm here (the gradient, or with ``rules``
    the LN-rule where RelP puts it); the MLP's and the logits' came through their norms in the run.
    """
    upstream = graph.upstream().tolist()
    per_layer = graph.attention_readers + 1
    for layer, spec in enumerate(graph.layers):
        weight, _ = reader_weights(model, graph, layer)
        out_grads = grads.attn[layer]  # (readers, batch, tokens, d_head)
        normed = torch.einsum("rbte,red->rbtd", out_grads, weight.to(out_grads.dtype))
        norm = model.get_submodule(spec.attn_norm)
        x = grads.attn_x[layer]
        if rules is not None and spec.attn_norm in rules.rms_norms + rules.layer_norms:
            through = norm_rule(norm, x)(normed.to(x.dtype))
        else:
            through = norm_vjp(norm.forward, x, normed)  # not __call__: no hooks
        readers = torch.cat([through, grads.mlp[layer][None]])
        first = layer * per_layer
        yield first, upstream[first : first + per_layer], wide(readers)
    yield len(graph.readers) - 1, upstream[-1:], wide(grads.final[None])


def _contract(total: torch.Tensor, deltas: torch.Tensor, grads: torch.Tensor, first: int, upstream: list[int]) -> None:
    """Add ``deltas[:n] . grads[r]`` into ``total[:n, first + r]``, one matrix product per upstream count ``n``."""
    flat = wide(grads).flatten(1).to(deltas.device, deltas.dtype)
    for n in sorted(set(upstream)):
        columns = [i for i, u in enumerate(upstream) if u == n]
        total[:n, first + columns[0] : first + columns[-1] + 1] += (deltas[:n].flatten(1) @ flat[columns].T).cpu()
