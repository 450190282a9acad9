"""The computational graph of a decoder-only transformer: its writers, its readers and the edges between them.

Writers add to the residual stream, in this order: ``"embed"`` (the residual stream entering the first layer: token
embeddings, plus position embeddings where the model adds them), then per layer ``L`` one ``"a{L}.h{H}"`` per query
head (that head's slice of the attention output projection's input times its weight slice, without the projection's
bias) and ``"m{L}"`` (the MLP's output). Readers take the residual stream in: per layer ``"a{L}.h{H}.q"`` per query
head, ``"a{L}.g{G}.k"`` and ``"a{L}.g{G}.v"`` per key/value group (on grouped-query attention one key and one value
reader per group, shared by the group's query heads; on plain multi-head attention ``G = H``), ``"m{L}"`` (the
MLP's input, before its norm), and ``"logits"`` (the final norm's input). An edge ``(writer, reader)`` joins a writer
to every reader downstream of it: a layer's heads feed its own MLP but not its own attention.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models import LayerLayout, LMLayout, lm_layout


@dataclass(frozen=True)
class Layer:
    """Qualified module names of one decoder layer (``q``/``k``/``v`` or a fused ``qkv``, q|k|v side by side)."""

    name: str
    attn_norm: str
    o: str
    mlp_norm: str
    mlp: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None


@dataclass(frozen=True)
class Graph:
    """Writers, readers and edges of a decoder-only transformer (see the module documentation).

    Example:
        >>> graph = Graph(layers=(), final_norm="norm", n_heads=2, n_groups=1, d_head=4)  # no layers: embed only
        >>> graph.writers, graph.readers, graph.n_edges
        (['embed'], ['logits'], 1)
    """

    layers: tuple[Layer, ...]
    final_norm: str
    n_heads: int
    n_groups: int
    d_head: int

    @property
    def writers(self) -> list[str]:
        """The writer names in graph order (``embed``, then per layer its heads and its MLP)."""
        names = ["embed"]
        for layer in range(len(self.layers)):
            names += [f"a{layer}.h{h}" for h in range(self.n_heads)] + [f"m{layer}"]
        return names

    @property
    def readers(self) -> list[str]:
        """The reader names in graph order (per layer q per head, k and v per group, the MLP; then ``logits``)."""
        names = []
        for layer in range(len(self.layers)):
            names += [f"a{layer}.h{h}.q" for h in range(self.n_heads)]
            names += [f"a{layer}.g{g}.k" for g in range(self.n_groups)]
            names += [f"a{layer}.g{g}.v" for g in range(self.n_groups)] + [f"m{layer}"]
        return [*names, "logits"]

    @property
    def attention_readers(self) -> int:
        """The number of readers of one layer's attention, ``H + 2 G``."""
        return self.n_heads + 2 * self.n_groups

    def upstream(self) -> torch.Tensor:
        """``(readers,)`` the number of writers feeding each reader: always the first ones, in graph order."""
        counts = []
        for layer in range(len(self.layers)):
            before = 1 + layer * (self.n_heads + 1)
            counts += [before] * self.attention_readers + [before + self.n_heads]
        return torch.tensor([*counts, len(self.writers)])

    def edge_mask(self) -> torch.Tensor:
        """``(writers, readers)`` boolean: True where (writer, reader) is an edge."""
        return torch.arange(len(self.writers))[:, None] < self.upstream()[None, :]

    @property
    def n_edges(self) -> int:
        """The number of edges."""
        return int(self.upstream().sum())

    def edge_indices(self, edges: Iterable[tuple[str, str]], what: str = "`circuit`") -> tuple[list[int], list[int]]:
        """Writer and reader indices of ``edges``; a ``KeyError`` lists unknown names, a ``ValueError`` non-edges."""
        writers = {n: i for i, n in enumerate(self.writers)}
        readers = {n: i for i, n in enumerate(self.readers)}
        edges = list(edges)
        unknown = sorted({w for w, _ in edges if w not in writers} | {r for _, r in edges if r not in readers})
        if unknown:
            hints = [_close(n, [*writers, *readers]) for n in unknown[:5]]
            raise KeyError(
                f"{what} names {len(unknown)} node(s) that are not in the model's graph: {unknown[:10]}"
                f"{' ...' if len(unknown) > 10 else ''}{''.join(hints)} (writers: 'embed', 'a{{L}}.h{{H}}', "
                "'m{L}'; readers: 'a{L}.h{H}.q', 'a{L}.g{G}.k', 'a{L}.g{G}.v', 'm{L}', 'logits')"
            )
        w = [writers[a] for a, _ in edges]
        r = [readers[b] for _, b in edges]
        upstream = self.upstream()
        wrong = [edges[i] for i in range(len(edges)) if w[i] >= upstream[r[i]]]
        if wrong:
            raise ValueError(
                f"{what} holds {len(wrong)} pair(s) that are not edges (the writer is not upstream of the reader): "
                f"{wrong[:5]}; a layer's heads feed its MLP and later layers, not their own attention"
            )
        return w, r


def _close(name: str, names: list[str]) -> str:
    match = difflib.get_close_matches(name, names, n=1)
    return f"; {name!r}: did you mean {match[0]!r}?" if match else ""


# -- reading the graph from a model ------------------------------------------------------------------------------
def read_graph(model: nn.Module, layout: LMLayout | None = None, **names: Any) -> Graph:
    """The graph of a HuggingFace-style decoder-only transformer, from :func:`attribution.lens.lm_layout`.

    Args:
        model: a causal language model (Llama, Qwen2, Mistral, Gemma, SmolLM2, GPT-2 and models named like them).
        layout: the model's :func:`attribution.models.lm_layout`, where the caller has read it already.
        **names: explicit module names and sizes for other layouts, passed to ``lm_layout``: ``layers``,
            ``final_norm``, ``children`` (``{"q": ..., "k": ..., "v": ...}`` or ``{"qkv": ...}``, ``"out_proj"``,
            ``"mlp"``, ``"attn_norm"``, ``"mlp_norm"``), ``n_heads``, ``n_kv_heads``.

    Returns:
        The :class:`Graph`.

    Raises:
        ValueError: a module that was not found (with the keyword that passes it), an attention output projection
            without a per-head layout, or a layout whose residual stream is not a sum of writers this graph knows
            (norms after each block as in Gemma 2/3, parallel attention and MLP, per-head fused q/k/v).

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=2, n_head=2)
        >>> graph = read_graph(transformers.GPT2LMHeadModel(config))
        >>> graph.writers[:4], graph.readers[:6], graph.n_edges
        (['embed', 'a0.h0', 'a0.h1', 'm0'], ['a0.h0.q', 'a0.h1.q', 'a0.g0.k', 'a0.g1.k', 'a0.g0.v', 'a0.g1.v'], 46)
    """
    layout = layout or lm_layout(model, **names)
    layers = tuple(_layer(model, spec) for spec in layout.layers)
    graph = Graph(layers, layout.final_norm, layout.n_heads, layout.n_kv_heads, layout.head_dim)
    for spec in layers:
        width = _in_features(model.get_submodule(spec.o))
        if width != graph.n_heads * graph.d_head:
            raise ValueError(
                f"the attention output projection {spec.o!r} takes {width} features, not {graph.n_heads} heads x "
                f"{graph.d_head}: it has no per-head layout, so head writers are not defined (pass `n_heads`)"
            )
    return graph


def _layer(model: nn.Module, spec: LayerLayout) -> Layer:
    """One layer's module names, or a ``ValueError`` for a layout whose edges this graph does not define."""
    if spec.sandwich:
        problem = "normalises its attention and MLP outputs before adding them (Gemma 2/3): they are not writers"
    elif spec.parallel:
        problem = "runs attention and MLP in parallel on the same residual stream (GPT-J, GPT-NeoX, Phi)"
    elif spec.attention.qkv_order == "per_head":
        problem = "interleaves query, key and value per head in its fused projection (GPT-NeoX)"
    elif spec.attn_norm is None or spec.mlp_norm is None:
        problem = "has no norm in front of its attention or MLP (pass `children={'attn_norm': ..., 'mlp_norm': ...}`)"
    else:
        problem = ""
    if problem:
        raise ValueError(f"layer {spec.module!r} {problem}: circuits are not supported for this layout")
    a = spec.attention
    return Layer(spec.module, spec.attn_norm, a.out_proj, spec.mlp_norm, spec.mlp, a.q, a.k, a.v, a.qkv)  # type: ignore[arg-type]


def _in_features(module: nn.Module) -> int:
    """The input width of a linear layer (``nn.Linear``, or GPT-2's ``Conv1D``), from its weight's shape alone."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(module).__name__} is not a linear layer with a 2-D weight")
    return int(weight.shape[0] if type(module).__name__ == "Conv1D" else weight.shape[1])
