"""A unit on one matplotlib axes pair: its distribution with the band edges, and its top examples as shaded text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .report import Example, Unit, UnitReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_unit(report: UnitReport, unit: Unit, *, examples: int = 5, axes: Any = None) -> tuple[Axes, Axes]:
    """Draw the unit's histogram of non-zero values (band edges dashed) and its top examples, tokens shaded.

    Args:
        report: a :class:`UnitReport`.
        unit: the unit's number or label.
        examples: how many top examples are written.
        axes: two axes to draw on (default: a new figure).

    Returns:
        The two axes.

    Example:
        >>> import torch
        >>> from attribution.features import Directions, feature_statistics
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 3))
        >>> report = feature_statistics(model, torch.randint(0, 10, (4, 9)), Directions(torch.eye(3), "0"), k=2,
        ...     context=(1, 1), bands=2, progress=False)
        >>> hist, text = plot_unit(report, 0)
        >>> hist.get_title().startswith("D0")
        True
    """
    import matplotlib.pyplot as plt  # only when drawing: importing attribution does not import matplotlib

    i = report.index(unit)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 2]})
    hist, text = axes
    edges, counts = report.histogram(i)
    widths = (edges[1:] - edges[:-1]).tolist()
    hist.bar(edges[:-1].tolist(), counts.tolist(), width=widths, align="edge", color="#d98c5f", edgecolor="none")
    if report.band_samples is not None:
        for edge in report.band_edges(i)[1:-1]:
            hist.axvline(edge, color="#555", lw=0.6, ls="--")
    hist.set_yscale("log" if int(counts.max()) > 0 else "linear")
    hist.set_title(f"{report.labels[i]}: density {float(report.density[i]):.3g}, max {float(report.max[i]):.3g}")
    hist.set_xlabel("activation (non-zero values; dashed: band edges)")
    hist.set_ylabel("count")
    _examples(text, report, report.top(i)[:examples], float(report.max[i]))
    return hist, text


def _examples(ax: Axes, report: UnitReport, top: list[Example], peak: float) -> None:
    """Each example's context on one line, each token boxed in a shade of its activation (the example in bold).

    Tokens are placed in points from the axes' left edge (a monospace character is 0.6 em wide), so that a later
    change of the layout does not move them apart.
    """
    ax.set_axis_off()
    ax.set_title("top examples (shade: activation / max)", fontsize=10)
    scale = peak if peak > 0 else 1.0
    for row, example in enumerate(top):
        y = 1 - (row + 0.7) / max(len(top), 1)
        x = 0.0
        ax.text(-0.01, y, f"{example.value:.3g}", ha="right", va="center", fontsize=9, transform=ax.transAxes)
        for j, (token, value) in enumerate(zip(example.tokens, example.activations, strict=True)):
            shade = max(0.0, min(1.0, value / scale))
            piece = report.text([token]).replace("\n", "\\n").replace("$", r"\$") or " "
            ax.annotate(piece, (0, y), xycoords="axes fraction", xytext=(x, 0), textcoords="offset points",
                        va="center", fontsize=9, family="monospace",
                        bbox={"facecolor": (1.0, 1 - 0.6 * shade, 1 - 0.8 * shade), "edgecolor": "none", "pad": 1},
                        fontweight="bold" if j == example.offset else "normal")  # fmt: skip
            x += 0.6 * 9 * len(piece) + 2
