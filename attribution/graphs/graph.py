"""The result of :func:`attribution.attribution_graph`: a node table, a sparse adjacency, influence and pruning."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ..dictionaries.modules import Dictionary
from ._math import node_influence, prune_masks, sparse

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .verify import Verification


@dataclass(frozen=True)
class Node:
    """One node of :class:`Nodes`: its kind, layer, position, index, activation and influence.

    ``kind`` is "token", "neuron", "feature", "error" or "logit"; ``layer`` -1 for tokens, the number of layers for
    logits; ``index`` the neuron's or feature's index, -1 for an error, or the token id; ``activation`` a logit
    node's value for a logit, an error's norm for an error.
    """

    kind: str
    layer: int
    position: int
    index: int
    activation: float
    influence: float


@dataclass(frozen=True)
class Nodes:
    """The node table, one entry per node in graph order (neurons and features, errors, tokens, logits).

    ``activation``: a neuron's or feature's activation, the norm of an error's vector (the MLP's output minus the
    dictionary's reconstruction), a token's embedding norm, a logit node's value (its logit minus the mean logit, or
    minus its foil's). ``influence``: each node's influence on the logits in the graph as attributed (kept through
    :meth:`attribution.AttributionGraph.prune`).
    """

    kind: tuple[str, ...]
    layer: torch.Tensor
    position: torch.Tensor
    index: torch.Tensor
    activation: torch.Tensor
    influence: torch.Tensor

    def __len__(self) -> int:
        return len(self.kind)

    def __getitem__(self, i: int) -> Node:
        return Node(self.kind[i], int(self.layer[i]), int(self.position[i]), int(self.index[i]),
                    float(self.activation[i]), float(self.influence[i]))  # fmt: skip

    def where(self, kind: str) -> torch.Tensor:
        """The node numbers of one kind.

        Example:
            >>> zeros = torch.zeros(2, dtype=torch.long)
            >>> nodes = Nodes(("neuron", "token"), zeros, zeros, zeros, torch.ones(2), torch.ones(2))
            >>> nodes.where("token")
            tensor([1])
        """
        return torch.tensor([i for i, k in enumerate(self.kind) if k == kind], dtype=torch.long)

    def subset(self, mask: torch.Tensor) -> Nodes:
        """The nodes where ``mask`` is true, in order."""
        keep = mask.nonzero().flatten()
        return Nodes(tuple(self.kind[i] for i in keep.tolist()), self.layer[keep], self.position[keep],
                     self.index[keep], self.activation[keep], self.influence[keep])  # fmt: skip


@dataclass(frozen=True)
class AttributionGraph:
    """One prompt's attribution graph (see :func:`attribution.attribution_graph`).

    Attributes:
        nodes: the node table (neurons and features by layer, then errors, tokens, logits).
        adjacency: sparse ``(n, n)``; ``adjacency[t, s]`` is the weight of the edge ``s -> t``.
        tokens: ``(T,)`` the prompt's token ids.
        logit_weights: ``(logits,)`` each logit node's weight in the influence (its probability; ``1 / pairs``
            for logit differences).
        foils: ``(logits,)`` each logit node's foil token (``-1``: the mean logit).
        n_layers: the model's layers.
        width: neurons per layer (of the model's MLPs).
        rules: ``None`` or ``"relp"``.
        inputs: what the model was called with (for :meth:`verify`).
        runs: backward runs of the autograd engine it took.
        node_threshold: the threshold it was pruned with (``None``: not pruned).
        units: per layer, the neurons or features a position has (``()``: ``width`` at every layer).
        basis: ``{MLP name: dictionary}`` of the layers whose nodes are features (empty: neurons only).
    """

    nodes: Nodes
    adjacency: torch.Tensor
    tokens: torch.Tensor
    logit_weights: torch.Tensor
    foils: torch.Tensor
    n_layers: int
    width: int
    rules: str | None
    inputs: Any = None
    runs: int = 0
    node_threshold: float | None = None
    units: Sequence[int] = ()
    basis: Mapping[str, Dictionary] = field(default_factory=dict)

    @property
    def weights(self) -> torch.Tensor:
        """``(n,)`` the logit weights on the logit nodes, zero elsewhere."""
        out = torch.zeros(len(self.nodes), dtype=torch.float64)
        out[self.nodes.where("logit")] = self.logit_weights.double()
        return out

    @property
    def influence(self) -> torch.Tensor:
        """``(n,)`` each node's influence on the logits through all paths of this graph (circuit-tracer's).

        The power series ``w A + w A^2 + ...`` of the row-normalised ``|adjacency|`` from the logit weights ``w``,
        on the sparse matrix.
        """
        return node_influence(self.adjacency.double(), self.weights)

    def with_influence(self) -> AttributionGraph:
        """The same graph with :attr:`influence` written into the node table."""
        return replace(self, nodes=replace(self.nodes, influence=self.influence))

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """circuit-tracer's ``prune_graph``: the nodes and then the edges that carry most of the logits' influence.

        Keeps the nodes that carry ``node_threshold`` of the influence (tokens and logits always), then the edges
        that carry ``edge_threshold`` of the edge influence, then removes, until none is left, neurons and features
        without a kept outgoing or incoming edge and errors without a kept outgoing one. Computed on the sparse
        matrix (only its non-zero entries are sorted).

        Args:
            node_threshold: in ``[0, 1]``.
            edge_threshold: in ``[0, 1]``.

        Returns:
            The pruned graph; its nodes keep the influence they had in this graph.
        """
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1]; got {value}")
        n_units = len(self.nodes.where("neuron")) + len(self.nodes.where("feature"))
        n_tail = len(self.nodes.where("token")) + len(self.nodes.where("logit"))
        mask, edges, _ = prune_masks(self.adjacency.double(), self.weights, n_units, n_tail, node_threshold,
                                     edge_threshold)  # fmt: skip
        return self.subgraph(mask, edges.to(self.adjacency.dtype), node_threshold)

    def subgraph(self, mask: torch.Tensor, edges: torch.Tensor | None = None, threshold: float | None = None
                 ) -> AttributionGraph:  # fmt: skip
        """The graph of the nodes where ``mask`` is true, with ``edges`` (sparse ``(n, n)``; all by default)."""
        edges = self.adjacency if edges is None else edges
        number = torch.cumsum(mask.long(), 0) - 1
        target, source = edges.indices()
        inside = mask[target] & mask[source]
        size = int(mask.sum())
        kept = sparse(torch.stack([number[target[inside]], number[source[inside]]]),
                                       edges.values()[inside], (size, size))  # fmt: skip
        return replace(self, nodes=self.nodes.subset(mask), adjacency=kept,
                       node_threshold=self.node_threshold if threshold is None else threshold)  # fmt: skip

    def to_json(self, path: str | Path, *, tokenizer: Any = None, scan: str = "neurons") -> dict[str, Any]:
        """Write circuit-tracer's graph file (its ``frontend/graph_models.py`` schema) and ``graph-metadata.json``.

        Usually called on a pruned graph. The slug is the file's stem; the nodes' ``influence`` is circuit-tracer's
        cumulative share (``attribution.graphs.export.graph_file`` builds the content).

        Returns:
            The file's content.
        """
        from .export import write_json

        return write_json(self, Path(path), tokenizer=tokenizer, scan=scan)

    def to_html(
        self, path: str | Path | None = None, *, tokenizer: Any = None, top_tokens: Any = None, features: Any = None
    ) -> str:
        """A self-contained HTML viewer: nodes by layer and position, edges by weight and sign, details on click.

        The drawing fits the window's width (from 60% to 150% of its size, scrolled beyond), so every node can be
        seen and clicked at any window width.

        Args:
            path: where to write the page (also returned).
            tokenizer: a tokenizer (its ``decode``) or a function from a token id to text.
            top_tokens: optional ``{node number: [text, ...]}``, shown for a clicked node (its top-activating tokens).
            features: optional :class:`~attribution.UnitReport` (of
                :func:`~attribution.feature_statistics` on the same model): a neuron or feature node whose
                unit it has (``report.find(kind, layer, index)``) is labelled by the token of its top example and,
                when clicked, shows its top examples (shaded, the example's token outlined), density, max and logit
                effects. The report's tokenizer decodes them (else ``tokenizer``).
        """
        from .export import html_page

        page = html_page(self, tokenizer=tokenizer, top_tokens=top_tokens, features=features)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def plot(self, *, tokenizer: Any = None, ax: Axes | None = None, title: str | None = None) -> Axes:
        """A matplotlib drawing: nodes by position (x) and layer (y), edges red (positive) or blue, width by weight."""
        from .plot import plot_graph

        return plot_graph(self, tokenizer=tokenizer, ax=ax, title=title)

    def verify(
        self, model: nn.Module, nodes: Any, *, kind: Literal["ablate", "steer"] = "ablate", scale: float = 0.0
    ) -> Verification:
        """The real model's change of each logit node's value when ``nodes`` are ablated or scaled, beside the graph's.

        ``nodes``: neuron node numbers; ``kind="ablate"`` sets them to zero, ``kind="steer"`` multiplies them by
        ``scale``. The real run patches the down projections' inputs; the prediction propagates the relative
        changes through the graph's edges (frozen attention and norms), layer by layer.
        """
        from .verify import verify

        return verify(self, model, nodes, kind=kind, scale=scale)
