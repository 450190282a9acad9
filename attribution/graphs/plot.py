"""A matplotlib drawing of an attribution graph (readable for 30-100 nodes: prune first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._inputs import decoder
from .export import logit_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .graph import AttributionGraph

POSITIVE, NEGATIVE = "#c0392b", "#1f77b4"  # edge colours, as in the HTML viewer
COLOURS = {"token": "#bbbbbb", "neuron": "#f2c14e", "feature": "#e59866", "error": "#ffffff", "logit": "#7fb77e"}


def node_positions(graph: AttributionGraph) -> torch.Tensor:
    """``(n, 2)`` drawing coordinates: x by position (nodes of one cell side by side), y by layer (tokens at -1).

    Example:
        >>> import torch
        >>> from attribution.graphs import AttributionGraph, Nodes
        >>> nodes = Nodes(("neuron", "neuron", "token"), torch.tensor([0, 0, -1]), torch.tensor([0, 0, 0]),
        ...               torch.tensor([1, 2, 5]), torch.ones(3), torch.zeros(3))
        >>> node_positions(AttributionGraph(nodes, torch.zeros(3, 3).to_sparse(), torch.tensor([5]), torch.ones(0),
        ...                                 torch.ones(0), 1, 4, None)).tolist()
        [[-0.25, 0.0], [0.25, 0.0], [0.0, -1.0]]
    """
    xy = torch.zeros(len(graph.nodes), 2)
    cells: dict[tuple[int, int], list[int]] = {}
    for i in range(len(graph.nodes)):
        cells.setdefault((int(graph.nodes.layer[i]), int(graph.nodes.position[i])), []).append(i)
    for (layer, position), members in cells.items():
        for j, i in enumerate(members):
            offset = 0.5 * (j / (len(members) - 1) - 0.5) if len(members) > 1 else 0.0  # side by side in the cell
            xy[i] = torch.tensor([position + offset, float(layer)])
    return xy


def plot_graph(graph: AttributionGraph, *, tokenizer: Any = None, ax: Axes | None = None, title: str | None = None
               ) -> Axes:  # fmt: skip
    """Nodes by position and layer; edges red (positive) or blue (negative), width and opacity by ``|weight|``.

    The legend names the node kinds and the two edge colours. A logit node is labelled by its token in quotes, and
    by its token and foil (``" are" vs " is"``) when its value is a logit difference.

    Args:
        graph: the graph (pruned to 30-100 nodes for a readable picture).
        tokenizer: a tokenizer or a function from a token id to text, for the labels.
        ax: the axes to draw into (a new figure when ``None``).
        title: the title.

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    text = decoder(tokenizer)

    def quoted(token: int) -> str:
        return f'"{text(token)}"'

    xy = node_positions(graph)
    if ax is None:
        width = max(6.0, 0.9 * len(graph.tokens) + 2)
        _, ax = plt.subplots(figsize=(width, max(4.0, 0.32 * (graph.n_layers + 2) + 1.5)))
    adjacency = graph.adjacency.coalesce()
    values = adjacency.values().double()
    top = float(values.abs().max()) if values.numel() else 1.0
    order = values.abs().argsort()  # the strongest drawn last, on top
    for k in order.tolist():
        t, s = adjacency.indices()[:, k].tolist()
        w = float(values[k]) / top
        ax.plot([xy[s, 0], xy[t, 0]], [xy[s, 1], xy[t, 1]], color=POSITIVE if w > 0 else NEGATIVE,
                linewidth=0.3 + 2.5 * abs(w), alpha=0.15 + 0.85 * abs(w), zorder=1)  # fmt: skip
    for kind, colour in COLOURS.items():
        members = graph.nodes.where(kind)
        if len(members):
            size = 22 if kind in ("neuron", "feature") else 60
            ax.scatter(xy[members, 0], xy[members, 1], s=size, c=colour, edgecolors="black", linewidths=0.5,
                       zorder=2, label=kind)  # fmt: skip
    for i in graph.nodes.where("logit").tolist():  # the label to the left: the logits sit in the last column
        ax.annotate(logit_label(graph, i, quoted), (float(xy[i, 0]), float(xy[i, 1])), xytext=(-6, 6),
                    textcoords="offset points", ha="right", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(graph.tokens)), [text(t) for t in graph.tokens.tolist()], rotation=60, fontsize=8)
    ax.set_yticks(range(-1, graph.n_layers + 1), ["emb", *[str(i) for i in range(graph.n_layers)], "logit"],
                  fontsize=7)  # fmt: skip
    ax.set_ylabel("layer")
    handles, labels = ax.get_legend_handles_labels()
    for colour, sign in ((POSITIVE, "positive"), (NEGATIVE, "negative")):
        handles.append(Line2D([], [], color=colour, linewidth=2))
        labels.append(f"{sign} edge")
    ax.legend(handles, labels, loc="upper left", fontsize=8, framealpha=0.8)
    ax.set_title(title or f"attribution graph: {len(graph.nodes)} nodes, {len(values)} edges", fontsize=10)
    return ax
