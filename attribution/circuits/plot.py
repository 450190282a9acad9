"""A drawing of a circuit: writers and readers laid out by layer and head, edges as lines of width by score."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .edges import EdgeScores

_READER = 0.32  # readers sit this far left of their block's column, writers on it


def node_position(name: str, heads: int, groups: int, layers: int, *, reader: bool) -> tuple[float, float]:
    """``(x, y)`` of a node in the drawing.

    x is the depth (embed 0, layer L's attention 2L+1, its MLP 2L+2, logits after the last layer; readers a little
    left of their block), y the head (k and v readers beside their group's heads; MLPs, embed and logits in the middle).

    Example:
        >>> node_position("a1.h2.q", 4, 2, 2, reader=True), node_position("m0", 4, 2, 2, reader=False)
        ((2.68, 2.0), (2.0, 1.5))
    """
    middle = (heads - 1) / 2
    shift = -_READER if reader else 0.0
    if name == "embed":
        return 0.0, middle
    if name == "logits":
        return 2.0 * layers + 1 - _READER, middle
    match = re.fullmatch(r"([am])(\d+)(?:\.([hg])(\d+))?(?:\.([qkv]))?", name)
    if match is None:
        raise ValueError(f"not a node name: {name!r}")
    kind, layer, unit, index, role = match.groups()
    layer = int(layer)
    if kind == "m":
        return 2.0 * layer + 2 + shift, middle
    x = 2.0 * layer + 1 + shift
    if unit == "h":
        return round(x, 6), float(index)
    size = heads // groups
    centre = int(index) * size + (size - 1) / 2
    return round(x, 6), centre + (-0.25 if role == "k" else 0.25)


def plot_circuit(scores: EdgeScores, n: int = 100, *, ax: Any = None, title: str | None = None) -> Any:
    """Draw the ``n`` edges of largest ``|score|`` of ``scores``, line width by ``|score|``.

    Red where the score is negative (corrupting the edge lowers the metric), blue where it is positive. Writers are
    dots, readers small squares left of their block; the nodes of the circuit are labelled.

    Returns:
        The matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    heads = sum(1 for w in scores.writers if w.startswith("a0.h"))
    groups = sum(1 for r in scores.readers if r.startswith("a0.g") and r.endswith(".k"))
    layers = sum(1 for w in scores.writers if w.startswith("m"))
    edges = scores.edges(n)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 1.1 * (2 * layers + 2)), max(4.0, 0.6 * heads + 2)))
    largest = max((abs(s) for *_, s in edges), default=1.0) or 1.0
    for writer, reader, score in sorted(edges, key=lambda e: abs(e[2])):
        x0, y0 = node_position(writer, heads, groups, layers, reader=False)
        x1, y1 = node_position(reader, heads, groups, layers, reader=True)
        colour = "tab:red" if score < 0 else "tab:blue"
        ax.plot([x0, x1], [y0, y1], color=colour, linewidth=0.3 + 4 * abs(score) / largest, alpha=0.7, zorder=1)
    used_writers = {w for w, _, _ in edges}
    used_readers = {r for _, r, _ in edges}
    for names, is_reader, marker in ((scores.writers, False, "o"), (scores.readers, True, "s")):
        points = [node_position(name, heads, groups, layers, reader=is_reader) for name in names]
        used = used_readers if is_reader else used_writers
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=[28 if m in used else 6 for m in names],
                   c=["black" if m in used else "lightgrey" for m in names], marker=marker, zorder=2)  # fmt: skip
        for name, (x, y) in zip(names, points, strict=True):
            if name in used:
                ax.annotate(name, (x, y), fontsize=6, xytext=(2, 3), textcoords="offset points", zorder=3)
    ticks = [0.0] + [2.0 * i + 1 for i in range(layers)] + [2.0 * i + 2 for i in range(layers)]
    labels = ["embed"] + [f"attn {i}" for i in range(layers)] + [f"mlp {i}" for i in range(layers)]
    ticks.append(2.0 * layers + 1 - _READER)
    labels.append("logits")
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_yticks(range(heads), [f"h{h}" for h in range(heads)], fontsize=7)
    ax.set_ylim(-0.8, heads - 0.2)
    ax.invert_yaxis()
    ax.set_title(title or f"{len(edges)} edges of largest |score| (red: negative, blue: positive)")
    return ax
