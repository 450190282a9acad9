"""A drawing of a circuit: one row per layer, the circuit's nodes spread along it, edges of width by score.

Rows go down the page in the order of the forward (``embed``, layer 0, ..., ``logits``), and hold only the nodes
the circuit uses, spread evenly and ordered by head so that k and v readers sit beside their group's query heads
and each head's q reader just before the head; the MLP (reader and writer, one node) closes its layer's row. Rows
without a node of the circuit are left out, so a circuit that skips layers stays compact.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .edges import EdgeScores

_NAME = re.compile(r"([am])(\d+)(?:\.([hg])(\d+))?(?:\.([qkv]))?")


def node_key(name: str, heads: int, groups: int) -> tuple[int, float]:
    """``(row, order within the row)`` of a node: row 0 is ``embed``, row ``L + 1`` layer ``L``, then ``logits``.

    Within a layer: the q reader of head ``h`` at ``h - 0.4``, the head at ``h``, the k and v readers of group ``g``
    at the first head of the group ``- 0.7`` and ``- 0.6``, the MLP last.

    Example:
        >>> node_key("a1.g1.k", 4, 2), node_key("a1.h2.q", 4, 2), node_key("m0", 4, 2), node_key("logits", 4, 2)
        ((2, 1.3), (2, 1.6), (1, 4.0), (1000000, 0.0))
    """
    if name == "embed":
        return 0, 0.0
    if name == "logits":
        return 1_000_000, 0.0
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a node name: {name!r}")
    kind, layer, unit, index, role = match.groups()
    row = int(layer) + 1
    if kind == "m":
        return row, float(heads)
    if unit == "h":
        return row, round(int(index) - (0.4 if role == "q" else 0.0), 6)
    first = int(index) * (heads // groups)
    return row, round(first - (0.7 if role == "k" else 0.6), 6)


def circuit_layout(nodes: list[str], heads: int, groups: int, gap: float = 0.08) -> dict[str, tuple[float, float]]:
    """``(x, y)`` of each node: y the rank of its row among the rows used (0 at the top), x in ``[0, 1]``.

    x starts at the node's place among the heads (``embed`` and ``logits`` in the middle, the MLP at the right);
    nodes of a row closer than ``gap`` are pushed apart (evenly spread when the row is too full for ``gap``), so that
    their labels do not overlap. A node written and read under one name (``m{L}``) gets one place.

    Example:
        >>> layout = circuit_layout(["embed", "a3.h1.q", "a3.h0", "logits"], heads=2, groups=1, gap=0.3)
        >>> layout["embed"], layout["a3.h0"], layout["a3.h1.q"], layout["logits"]
        ((0.5, 0.0), (0.333333, 1.0), (0.633333, 1.0), (0.5, 2.0))
    """
    rows: dict[int, list[tuple[float, str]]] = {}
    for name in dict.fromkeys(nodes):
        row, order = node_key(name, heads, groups)
        natural = 0.5 if name in ("embed", "logits") else (order + 1) / (heads + 1)
        rows.setdefault(row, []).append((natural, name))
    places = {}
    for y, row in enumerate(sorted(rows)):
        members = sorted(rows[row])
        xs = _spread([x for x, _ in members], min(gap, 1 / max(len(members) - 1, 1)))
        places.update({name: (round(x, 6), float(y)) for x, (_, name) in zip(xs, members, strict=True)})
    return places


def _spread(xs: list[float], gap: float) -> list[float]:
    """Sorted positions in ``[0, 1]`` moved as little as this greedy pass does so that neighbours are ``gap`` apart."""
    out = [min(max(x, 0.0), 1.0) for x in xs]
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    out[-1] = min(out[-1], 1.0)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1] - gap)
    return out


def plot_circuit(scores: EdgeScores, n: int = 100, *, ax: Any = None, title: str | None = None) -> Any:
    """Draw the ``n`` edges of largest ``|score|`` of ``scores``: one row per layer, line width by ``|score|``.

    Red where the score is negative (corrupting the edge lowers the metric: the edge carries the behaviour), blue
    where it is positive. Writers are dots, readers squares (an MLP, both, a dot); edges within a row (a head to its
    own layer's MLP) are arcs, edges between nodes one above the other wider arcs, the others slightly bent, so that
    they do not run through the nodes between them. The rows are labelled by layer on the left.

    Args:
        scores: the edge scores.
        n: how many edges to draw.
        ax: a matplotlib ``Axes`` to draw into; by default a new figure sized to the circuit.
        title: the title; by default the number of edges and what the colours mean.

    Returns:
        The matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    heads = sum(1 for w in scores.writers if w.startswith("a0.h"))
    groups = sum(1 for r in scores.readers if r.startswith("a0.g") and r.endswith(".k"))
    edges = scores.edges(n)
    nodes = [name for w, r, _ in edges for name in (w, r)]
    places = circuit_layout(nodes, heads, groups)
    rows = {node_key(name, heads, groups)[0]: y for name, (_, y) in places.items()}
    widest = max([sum(1 for _, y in places.values() if y == row) for row in rows.values()] or [1])
    own_figure = ax is None
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.85 * widest + 1.5), max(3.0, 0.42 * len(rows) + 1.2)))
    largest = max((abs(s) for *_, s in edges), default=1.0) or 1.0
    for writer, reader, score in sorted(edges, key=lambda e: abs(e[2])):
        start, end = places[writer], places[reader]
        bend = -0.35 if start[1] == end[1] else 0.3 if abs(start[0] - end[0]) < 0.03 else 0.06  # arcs apart
        ax.add_patch(FancyArrowPatch(
            start, end, arrowstyle="-", connectionstyle=f"arc3,rad={bend}",
            color="tab:red" if score < 0 else "tab:blue", linewidth=0.4 + 4.5 * abs(score) / largest, alpha=0.55,
            zorder=1, shrinkA=3, shrinkB=3,
        ))  # fmt: skip
    writers = {w for w, _, _ in edges}
    for name, (x, y) in places.items():
        reader_only = name not in writers and name != "logits"
        ax.scatter([x], [y], s=22, marker="s" if reader_only or name == "logits" else "o", color="black", zorder=2)
        box = {"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}
        ax.annotate(name, (x, y), xytext=(0, -7), textcoords="offset points", ha="center", va="top", fontsize=6.5,
                    zorder=3, bbox=box)  # fmt: skip
    names = {0: "embed", 1_000_000: "logits"}
    ax.set_yticks(list(rows.values()), [names.get(row, f"layer {row - 1}") for row in rows], fontsize=7)
    ax.set_xticks([])
    ax.set_xlim(-0.06, 1.06)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"{len(edges)} edges of largest |score| (red: negative, blue: positive)", fontsize=9)
    if own_figure:
        ax.figure.tight_layout()
    return ax
