"""Patching results: heatmaps of sweeps, attribution patching against exact patching, path-patching bars."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .._maps import spearman
from ..patching.result import PatchingResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_patching(
    result: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    ax: Axes | None = None,
    cmap: str = "RdBu_r",
    title: str | None = None,
    colorbar: bool = True,
    annotate: bool = False,
    limits: tuple[float, float] | None = None,
) -> Axes:
    """Heatmap of an activation-patching result, with a diverging colour map centred at zero.

    A sweep's result (a :class:`~attribution.patching.PatchingResult`) labels the plot itself: the rows with its
    module names, the columns with its positions (or heads); explicit ``tokens`` and ``layers`` win. ``tokens`` for
    every position of the input label the positions a sweep ran on (``positions=[2, -1]``: ``tokens[2]``,
    ``tokens[-1]``).

    Args:
        result: ``(layers,)``, ``(layers, positions)`` or ``(layers, heads)``; ``(layers, positions, heads)`` is
            drawn with one row per layer and head (``L0.H1``...). A per-example result: pick an example first
            (``result.isel(example=0)``).
        tokens: labels of the positions (the x axis), e.g. the input tokens.
        layers: labels of the rows (default: the result's module names, else ``L0``, ``L1``...).
        ax: axes to draw on (default: a new figure).
        cmap: a diverging colour map; the colour limits are symmetric around 0.
        title: axes title.
        colorbar: add a colour bar.
        annotate: write each value in its cell.
        limits: the colour limits ``(low, high)`` (e.g. ``(0, 1)`` for accuracies with a sequential ``cmap``);
            default: symmetric around 0 at the largest absolute value.

    Returns:
        The axes.

    Example:
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> from attribution.patching import PatchingResult
        >>> result = PatchingResult(torch.ones(2, 2), {"layer": ["blocks.0", "blocks.1"], "position": [0, -1]})
        >>> ax = plot_patching(result, tokens=["The", "cat", "sat"])
        >>> [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()]
        (['blocks.0', 'blocks.1'], ['The', 'sat'])
    """
    import matplotlib.pyplot as plt

    layers, tokens = _carried(result, layers, tokens)
    values = torch.as_tensor(result).detach().float().cpu()
    row_labels = list(layers) if layers is not None else [f"L{i}" for i in range(values.shape[0])]
    if values.dim() == 1:
        values = values[:, None]
        columns: list[str] = [""]
    elif values.dim() == 3:
        n_layers, n_pos, n_heads = values.shape
        values = values.permute(0, 2, 1).reshape(n_layers * n_heads, n_pos)
        row_labels = [f"{name}.H{h}" for name in row_labels for h in range(n_heads)]
        columns = list(tokens) if tokens is not None else [str(p) for p in range(n_pos)]
    elif values.dim() == 2:
        columns = list(tokens) if tokens is not None else [str(p) for p in range(values.shape[1])]
    else:
        raise ValueError(f"`result` must have 1 to 3 axes (layers, positions/heads, heads); got {tuple(values.shape)}")
    if len(columns) != values.shape[1]:
        raise ValueError(f"{len(columns)} `tokens` for {values.shape[1]} columns")
    if len(row_labels) != values.shape[0]:
        raise ValueError(f"{len(row_labels)} `layers` labels for {values.shape[0]} rows")
    if ax is None:
        _, ax = plt.subplots(figsize=(max(3.0, 0.55 * values.shape[1] + 2), max(2.0, 0.35 * values.shape[0] + 1)))
    finite = values[torch.isfinite(values)]  # a normalised cell can be NaN when clean == corrupted
    limit = float(finite.abs().max()) if finite.numel() else 1.0
    limit = limit or 1.0
    low, high = limits if limits is not None else (-limit, limit)
    image = ax.imshow(values.numpy(), cmap=cmap, vmin=low, vmax=high, aspect="auto")
    ax.set_xticks(
        range(values.shape[1]),
        columns,
        rotation=45 if any(len(c) > 3 for c in columns) else 0,
        ha="right" if any(len(c) > 3 for c in columns) else "center",
    )
    ax.set_yticks(range(values.shape[0]), row_labels)
    if annotate:
        for (i, j), v in np.ndenumerate(values.numpy()):
            ax.text(
                j,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color=_text_colour(v, low, high, limits is None),
            )
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title)
    return ax


def _text_colour(value: float, low: float, high: float, diverging: bool) -> str:
    """White on the dark cells: far from 0 on a diverging map, in the lower half on a sequential one (viridis)."""
    if diverging:
        return "white" if abs(value) > 0.6 * high else "black"
    return "white" if value < low + 0.5 * (high - low) else "black"


def _carried(
    result: torch.Tensor, layers: Sequence[str] | None, tokens: Sequence[str] | None
) -> tuple[Sequence[str] | None, Sequence[str] | None]:
    """The row and column labels: the explicit ones, else those a :class:`PatchingResult` carries."""
    if not isinstance(result, PatchingResult):
        return layers, tokens
    if "example" in result.axes:
        raise ValueError(
            f"`result` has an example axis (axes {result.axes}, from per_example=True): plot one example, "
            "result.isel(example=i), or pass their mean as a plain tensor"
        )
    if layers is None:
        layers = [str(label) for label in result.labels[result.axes[0]]]
    if "position" in result.axes:
        positions = result.labels["position"]
        if tokens is None:
            tokens = [str(p) for p in positions]
        elif len(tokens) != len(positions) and all(-len(tokens) <= p < len(tokens) for p in positions):
            tokens = [tokens[p] for p in positions]  # tokens of the whole input, the sweep ran on some positions
    elif "head" in result.axes and tokens is None and result.dim() == 2:
        tokens = [f"H{h}" for h in result.labels["head"]]
    elif tokens is None and result.dim() == 2:  # another second axis (an intervention sweep's k): its labels
        axis = result.axes[1]
        tokens = [f"{axis}={label}" for label in result.labels[axis]]
    return layers, tokens


def _cell_labels(shape: Sequence[int], layers: Sequence[str] | None, tokens: Sequence[str] | None) -> list[str]:
    """One label per cell of a patching result (row-major): ``L3``, ``L3 t5`` or ``L3.H2`` / ``L3.H2 t5``."""
    rows = list(layers) if layers is not None else [f"L{i}" for i in range(shape[0])]
    if len(rows) != shape[0]:
        raise ValueError(f"{len(rows)} `layers` labels for {shape[0]} layers")
    if len(shape) == 1:
        return rows
    columns = list(tokens) if tokens is not None else [str(p) for p in range(shape[1])]
    if len(columns) != shape[1]:
        raise ValueError(f"{len(columns)} `tokens` for {shape[1]} columns")
    if len(shape) == 2:
        return [f"{row} {column}" for row in rows for column in columns]
    if len(shape) == 3:
        return [f"{row}.H{h} {column}" for row in rows for column in columns for h in range(shape[2])]
    raise ValueError(f"a patching result has 1 to 3 axes (layers, positions/heads, heads); got {tuple(shape)}")


def plot_atp_vs_exact(
    estimate: torch.Tensor,
    exact: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    annotate: int = 5,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Scatter of attribution-patching estimates against exact patching results, cell for cell, with the diagonal.

    A point on the dashed diagonal is a cell that attribution patching estimates exactly; the legend gives the
    Spearman rank correlation (ties share their mean rank) and Pearson's correlation.

    Args:
        estimate: the result of :func:`attribution.attribution_patching`.
        exact: the result of :func:`attribution.activation_patching` for the same cells (same shape).
        tokens: labels of the second axis (positions, or heads of a ``(layers, heads)`` result); default: the
            labels the results carry (as in :func:`plot_patching`).
        layers: labels of the first axis (default: the results' module names, else ``L0``, ``L1``...).
        annotate: label this many cells, those with the largest exact effect ``|exact - median(exact)|``.
        ax: axes to draw on (default: a new figure).
        title: axes title.

    Returns:
        The axes.

    Example:
        >>> import torch, matplotlib
        >>> matplotlib.use("Agg")
        >>> exact = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
        >>> ax = plot_atp_vs_exact(exact * 0.9, exact, annotate=1)
        >>> ax.get_legend().get_texts()[0].get_text(), ax.texts[0].get_text()
        ('cells (Spearman 1.00, Pearson 1.00)', 'L1 1')
    """
    import matplotlib.pyplot as plt

    layers, tokens = _carried(exact if isinstance(exact, PatchingResult) else estimate, layers, tokens)
    y = torch.as_tensor(estimate).detach().double().cpu()
    x = torch.as_tensor(exact).detach().double().cpu()
    if x.shape != y.shape:
        raise ValueError(f"`estimate` {tuple(y.shape)} and `exact` {tuple(x.shape)} must have the same shape")
    labels = _cell_labels(x.shape, layers, tokens) if 1 <= x.dim() <= 3 else [str(i) for i in range(x.numel())]
    x, y = x.flatten(), y.flatten()
    finite = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[finite], y[finite]
    labels = [label for label, keep in zip(labels, finite.tolist(), strict=True) if keep]
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 4.5), layout="constrained")
    if len(x) > 1:
        rho = float(spearman(x[None], y[None])[0])
        pearson = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
        name = f"cells (Spearman {rho:.2f}, Pearson {pearson:.2f})"
    else:
        name = "cells"
    ax.scatter(x.numpy(), y.numpy(), s=14, alpha=0.7, color="tab:blue", edgecolors="none", label=name, zorder=3)
    if len(x):
        low, high = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
        pad = 0.05 * (high - low) or 1.0
        ax.plot([low - pad, high + pad], [low - pad, high + pad], "--", color="grey", linewidth=1, label="y = x")
        order = (x - x.median()).abs().argsort(descending=True)[:annotate]
        for i in order.tolist():
            ax.annotate(labels[i], (float(x[i]), float(y[i])), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("exact activation patching")
    ax.set_ylabel("attribution patching (estimate)")
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def plot_path_patching(
    path: torch.Tensor,
    total: torch.Tensor | None = None,
    *,
    tokens: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    top: int | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Horizontal bars of path-patching results, one per sender cell, beside the total effect when given.

    Pass normalised results (``normalize=True``: 0 is the base run, 1 the source run) so that a bar's length is the
    share of the base-to-source change; the total effect (:func:`attribution.activation_patching` of the same cells,
    normalised alike) is drawn as an outlined bar behind, so that the filled part shows how much of a sender's effect
    goes through the receivers. Positive bars are red, negative blue (``plot_patching``'s colour map ends).

    Args:
        path: the result of :func:`attribution.path_patching`, ``(senders[, positions][, heads])``.
        total: the total effect of the same cells (same shape), or None.
        tokens: labels of the second axis (positions, or heads of a ``(senders, heads)`` result); default: the
            labels the result carries (as in :func:`plot_patching`).
        layers: labels of the senders (default: the result's module names, else ``L0``, ``L1``...).
        top: draw only the ``top`` cells of largest ``|path|``, strongest first (default: every cell, in order).
        ax: axes to draw on (default: a new figure).
        title: axes title.

    Returns:
        The axes.

    Example:
        >>> import torch, matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = plot_path_patching(torch.tensor([0.1, -0.4]), torch.tensor([0.5, -0.5]), layers=["a", "b"])
        >>> [t.get_text() for t in ax.get_yticklabels()]
        ['a', 'b']
    """
    import matplotlib.pyplot as plt

    layers, tokens = _carried(path, layers, tokens)
    values = torch.as_tensor(path).detach().double().cpu()
    if total is not None and tuple(torch.as_tensor(total).shape) != tuple(values.shape):
        raise ValueError(
            f"`total` {tuple(torch.as_tensor(total).shape)} must have the shape of `path` {tuple(values.shape)}"
        )
    labels = _cell_labels(values.shape, layers, tokens)
    flat = values.flatten()
    whole = torch.as_tensor(total).detach().double().cpu().flatten() if total is not None else None
    order = list(range(len(flat)))
    if top is not None:
        order = flat.abs().nan_to_num(-1.0).argsort(descending=True)[:top].tolist()
    if ax is None:
        _, ax = plt.subplots(figsize=(5, max(2.0, 0.3 * len(order) + 1)), layout="constrained")
    cmap = plt.get_cmap("RdBu_r")
    rows = np.arange(len(order))
    colours = [cmap(0.85) if flat[i] >= 0 else cmap(0.15) for i in order]
    if whole is not None:
        ax.barh(rows, whole[order].numpy(), height=0.8, color="none", edgecolor="grey", linewidth=1)
    ax.barh(rows, flat[order].numpy(), height=0.5, color=colours)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(rows, [labels[i] for i in order])
    ax.invert_yaxis()
    if whole is not None:
        from matplotlib.patches import Patch

        handles = [
            Patch(facecolor="none", edgecolor="grey", label="total effect"),
            Patch(facecolor=cmap(0.85), label="through the receivers (+)"),
            Patch(facecolor=cmap(0.15), label="through the receivers (-)"),
        ]
        ax.legend(handles=handles, fontsize=8, loc="best")
    if title:
        ax.set_title(title)
    return ax
