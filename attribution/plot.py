"""Plots of saliency maps, token relevance, patching results and metrics (matplotlib, imported inside the functions).

Every function follows matplotlib's habits: it draws on ``ax=`` when given (else on a new figure), returns the axes
or figure it drew on, never calls ``plt.show()``, and works with the Agg backend. Images may be tensors
``(C, H, W)`` / ``(B, C, H, W)``, numpy arrays ``(H, W, C)`` or PIL images; ``mean``/``std`` undo a normalisation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from .metrics._similarity import spearman

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .metrics import CurveResult, RandomizationResult


def to_rgb(image: Any, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> np.ndarray:
    """An image as a float array ``(H, W, 3)`` in [0, 1], normalisation undone.

    Args:
        image: tensor ``(C, H, W)`` or ``(H, W)``, numpy array ``(H, W, C)`` or ``(H, W)``, or a PIL image.
        mean: per-channel mean that was subtracted (tensors only).
        std: per-channel standard deviation that was divided by (tensors only).
    """
    if not isinstance(image, torch.Tensor) and np.asarray(image).ndim == 3:
        array = np.asarray(image)
        if array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3, 4):  # channel-first numpy: as a tensor
            image = torch.as_tensor(array)
    if isinstance(image, torch.Tensor):
        scale = 255.0 if image.dtype == torch.uint8 else 1.0
        x = image.detach().float().cpu() / scale
        while x.dim() > 3 and x.shape[0] == 1:  # a batch of one
            x = x[0]
        if x.dim() == 2:
            x = x[None]
        if x.dim() != 3:
            raise ValueError(f"`image` must be (C, H, W) or (H, W); got shape {tuple(image.shape)}")
        if std is not None:
            x = x * torch.as_tensor(std, dtype=x.dtype)[:, None, None]
        if mean is not None:
            x = x + torch.as_tensor(mean, dtype=x.dtype)[:, None, None]
        if x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        array = x.permute(1, 2, 0).numpy()
        if mean is None and std is None and (array.min() < 0 or array.max() > 1):  # an unknown scale: stretch it
            array = (array - array.min()) / max(float(array.max() - array.min()), 1e-12)
        return np.clip(array, 0, 1)
    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    if array.max() > 1:
        array = array / 255.0
    return np.clip(array[..., :3], 0, 1)


def _map_array(saliency: Any, size: tuple[int, int]) -> np.ndarray:
    """A saliency map as ``(H, W)`` numpy, bilinearly resized to ``size`` when needed."""
    s = torch.as_tensor(np.asarray(saliency.detach().cpu() if isinstance(saliency, torch.Tensor) else saliency))
    s = s.float().squeeze()
    if s.dim() != 2:
        raise ValueError(f"a saliency map must be (H, W); got shape {tuple(s.shape)}")
    if tuple(s.shape) != size:
        s = F.interpolate(s[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
    return s.numpy()


def overlay(
    image: Any,
    saliency: Any,
    *,
    ax: Axes | None = None,
    cmap: str = "jet",
    alpha: float = 0.5,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    contour: bool | Sequence[float] = False,
    colorbar: bool = False,
    title: str | None = None,
    vmin: float | None = 0.0,
    vmax: float | None = None,
) -> Axes:
    """Draw ``saliency`` over ``image``.

    Args:
        image: the image (see :func:`to_rgb`).
        saliency: map ``(h, w)``; resized bilinearly to the image when its size differs.
        ax: axes to draw on (default: a new figure).
        cmap: colour map of the saliency.
        alpha: opacity of the saliency layer.
        mean: normalisation mean to undo on a tensor image.
        std: normalisation standard deviation to undo on a tensor image.
        contour: draw contour lines of the map (True for levels 0.5 and 0.8, or the levels to draw).
        colorbar: add a colour bar for the saliency.
        title: axes title.
        vmin: lower end of the colour scale (default 0; None for the map's minimum).
        vmax: upper end (default: the map's maximum).

    Returns:
        The axes.

    Example:
        >>> import torch, matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = overlay(torch.rand(3, 32, 32), torch.rand(8, 8), colorbar=True)
        >>> ax.images[-1].get_array().shape
        (32, 32)
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    rgb = to_rgb(image, mean, std)
    heat = _map_array(saliency, rgb.shape[:2])
    ax.imshow(rgb)
    artist = ax.imshow(heat, cmap=cmap, alpha=alpha, vmin=vmin, vmax=vmax)
    if contour is not False:
        levels = [0.5, 0.8] if contour is True else list(contour)
        top = float(heat.max()) or 1.0
        ax.contour(heat / top, levels=levels, colors="white", linewidths=1.0)
    if colorbar:
        ax.figure.colorbar(artist, ax=ax, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title)
    ax.set_axis_off()
    return ax


def show_batch(
    images: torch.Tensor,
    saliency: torch.Tensor,
    *,
    titles: Sequence[str] | None = None,
    ncols: int = 4,
    **kwargs: Any,
) -> Figure:
    """Overlay each map of a batch on its image, in a grid.

    Args:
        images: ``(B, C, H, W)``.
        saliency: ``(B, h, w)``.
        titles: one title per image.
        ncols: grid width.
        **kwargs: passed to :func:`overlay` (``cmap``, ``alpha``, ``mean``, ``std``, ``contour``...).

    Returns:
        The figure.
    """
    import matplotlib.pyplot as plt

    images, saliency = torch.as_tensor(images), torch.as_tensor(saliency)
    if images.dim() != 4 or saliency.dim() != 3 or len(images) != len(saliency):
        raise ValueError(
            f"`images` (B, C, H, W) and `saliency` (B, h, w) must match; got {tuple(images.shape)} and "
            f"{tuple(saliency.shape)}"
        )
    n = len(images)
    cols = min(ncols, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < n:
            overlay(images[i], saliency[i], ax=ax, title=titles[i] if titles else None, **kwargs)
        else:
            ax.set_axis_off()
    fig.tight_layout()
    return fig


def compare(image: Any, maps: Mapping[str, Any], *, with_image: bool = True, **kwargs: Any) -> Figure:
    """Several methods' maps for the same image, side by side (e.g. Grad-CAM, Grad-CAM++, rollout).

    Args:
        image: the image (see :func:`to_rgb`).
        maps: method name -> map ``(h, w)``.
        with_image: show the plain image first.
        **kwargs: passed to :func:`overlay`.

    Returns:
        The figure.
    """
    import matplotlib.pyplot as plt

    if "ax" in kwargs:
        raise TypeError("compare() draws a figure of its own, one panel per map; draw on given axes with overlay(ax=)")
    panels = len(maps) + int(with_image)
    fig, grid = plt.subplots(1, panels, figsize=(3 * panels, 3.2), squeeze=False)
    axes = list(grid[0])
    if with_image:
        ax = axes.pop(0)
        ax.imshow(to_rgb(image, kwargs.get("mean"), kwargs.get("std")))
        ax.set_title("image")
        ax.set_axis_off()
    for ax, (name, m) in zip(axes, maps.items(), strict=True):
        overlay(image, m, ax=ax, title=name, **kwargs)
    fig.tight_layout()
    return fig


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
) -> Axes:
    """Heatmap of an activation-patching result, with a diverging colour map centred at zero.

    Args:
        result: ``(layers,)``, ``(layers, positions)`` or ``(layers, heads)``; ``(layers, positions, heads)`` is
            drawn with one row per layer and head (``L0.H1``...).
        tokens: labels of the positions (the x axis), e.g. the input tokens.
        layers: labels of the rows (default ``L0``, ``L1``...).
        ax: axes to draw on (default: a new figure).
        cmap: a diverging colour map; the colour limits are symmetric around 0.
        title: axes title.
        colorbar: add a colour bar.
        annotate: write each value in its cell.

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt

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
    image = ax.imshow(values.numpy(), cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(
        range(values.shape[1]),
        columns,
        rotation=45 if tokens is not None else 0,
        ha="right" if tokens is not None else "center",
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
                color="white" if abs(v) > 0.6 * limit else "black",
            )
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title)
    return ax


def show_tokens(
    tokens: Sequence[str],
    relevance: Any,
    *,
    ax: Axes | None = None,
    cmap: str = "Reds",
    title: str | None = None,
    per_line: int = 12,
    normalize: bool = True,
) -> Axes:
    """Tokens as boxes coloured by their relevance, in reading order (for text models).

    Args:
        tokens: the token strings.
        relevance: one value per token, ``(tokens,)``.
        ax: axes to draw on (default: a new figure sized to the text).
        cmap: colour map; darker means more relevant.
        title: axes title.
        per_line: tokens per line before wrapping.
        normalize: scale the relevances to [0, 1] (min-max) before colouring.

    Returns:
        The axes.

    Example:
        >>> import torch, matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = show_tokens(["the", "cat", "sat"], torch.tensor([0.1, 0.9, 0.3]))
        >>> [t.get_text() for t in ax.texts]
        ['the', 'cat', 'sat']
    """
    import matplotlib.pyplot as plt

    values = torch.as_tensor(np.asarray(relevance.detach().cpu() if isinstance(relevance, torch.Tensor) else relevance))
    values = values.float().flatten()
    if len(tokens) != len(values):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} relevance values; give one value per token")
    if normalize and len(values):
        span = float(values.max() - values.min())
        values = (values - values.min()) / span if span > 0 else torch.zeros_like(values)
    lines = max(1, -(-len(tokens) // per_line))
    if ax is None:
        _, ax = plt.subplots(figsize=(min(per_line, len(tokens) or 1) * 0.9 + 0.5, 0.55 * lines + 0.4))
    colours = plt.get_cmap(cmap)
    for i, (token, value) in enumerate(zip(tokens, values.tolist(), strict=True)):
        row, col = divmod(i, per_line)
        ax.text(
            col,
            -row,
            token,
            ha="center",
            va="center",
            fontsize=10,
            color="white" if value > 0.6 else "black",
            bbox={"boxstyle": "round,pad=0.25", "facecolor": colours(value), "edgecolor": "none"},
        )
    ax.set_xlim(-0.6, min(per_line, max(len(tokens), 1)) - 0.4)
    ax.set_ylim(-lines + 0.5, 0.5)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return ax


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
        estimate: the result of :func:`attribution.attribution_patching.attribution_patching`.
        exact: the result of :func:`attribution.activation_patching` for the same cells (same shape).
        tokens: labels of the second axis (positions, or heads of a ``(layers, heads)`` result).
        layers: labels of the first axis (default ``L0``, ``L1``...).
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
        path: the result of :func:`attribution.path_patching.path_patching`, ``(senders[, positions][, heads])``.
        total: the total effect of the same cells (same shape), or None.
        tokens: labels of the second axis (positions, or heads of a ``(senders, heads)`` result).
        layers: labels of the senders (default ``L0``, ``L1``...).
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


def plot_curves(
    results: CurveResult | Mapping[str, CurveResult],
    *,
    item: int | None = 0,
    ax: Axes | None = None,
    title: str | None = None,
    legend: bool = True,
) -> Axes:
    """Deletion or insertion curves (:func:`attribution.metrics.deletion`, :func:`~attribution.metrics.insertion`).

    One line per result, labelled with its name and the area under its curve.

    Args:
        results: a :class:`~attribution.metrics.CurveResult`, or method name -> result.
        item: which image of the batch; ``None`` draws the mean curve over the batch (and the mean area).
        ax: axes to draw on (default: a new figure).
        title: axes title.
        legend: add a legend.

    Returns:
        The axes.

    Example:
        >>> import torch, matplotlib
        >>> matplotlib.use("Agg")
        >>> from attribution.metrics import CurveResult
        >>> curve = CurveResult("deletion", torch.linspace(0, 1, 5), torch.tensor([[0.9, 0.5, 0.2, 0.1, 0.0]]),
        ...                     torch.tensor([0.3]))
        >>> [t.get_text() for t in plot_curves({"Grad-CAM": curve}).get_legend().get_texts()]
        ['Grad-CAM (AUC 0.300)']
    """
    import matplotlib.pyplot as plt

    named = {results.kind: results} if not isinstance(results, Mapping) else dict(results)
    if not named:
        raise ValueError("`results` is empty; give a CurveResult or a mapping of names to CurveResults")
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3.2))
    for name, result in named.items():
        scores, area = result.scores.detach().float().cpu(), result.auc.detach().float().cpu()
        if item is None:
            scores, area = scores.mean(dim=0), area.mean()
        else:
            if not -len(scores) <= item < len(scores):
                raise ValueError(f"`item` {item} is out of range for a batch of {len(scores)}")
            scores, area = scores[item], area[item]
        ax.plot(result.fractions.cpu().numpy(), scores.numpy(), label=f"{name} (AUC {float(area):.3f})")
    kinds = {result.kind for result in named.values()}
    action = {"deletion": "removed", "insertion": "revealed"}
    ax.set_xlabel(f"share of pixels {action[kinds.pop()]}" if len(kinds) == 1 else "share of pixels perturbed")
    ax.set_ylabel("score of the target")
    ax.set_xlim(0, 1)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def plot_randomization(
    result: RandomizationResult,
    image: Any = None,
    *,
    item: int = 0,
    ncols: int = 6,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    **kwargs: Any,
) -> Figure:
    """The maps of a randomisation test (:func:`attribution.metrics.randomization_test`) for one image, in a grid.

    The original map first, then one panel per stage, titled with the layer randomised and the map's Spearman
    correlation and SSIM with the original.

    Args:
        result: the test's result.
        image: the image, to draw the maps over it (see :func:`to_rgb`); without it the maps are drawn alone.
        item: which image of the batch.
        ncols: panels per row.
        mean: normalisation mean to undo on a tensor image.
        std: normalisation standard deviation to undo on a tensor image.
        **kwargs: passed to :func:`overlay` (``cmap``, ``alpha``...).

    Returns:
        The figure.
    """
    import matplotlib.pyplot as plt

    batch = result.original.shape[0]
    if not -batch <= item < batch:
        raise ValueError(f"`item` {item} is out of range for a batch of {batch}")
    if "ax" in kwargs:
        raise TypeError("plot_randomization() draws a figure of its own, one panel per stage")
    panels = [("original", result.original[item])]
    for s, stage in enumerate(result.stages):
        rho, similarity = (_number(float(x[s, item])) for x in (result.spearman, result.ssim))
        label = f"{'up to ' if result.mode == 'cascading' and s else ''}{stage}"
        panels.append((f"{label}\nSpearman {rho}, SSIM {similarity}", result.maps[s, item]))
    cols = min(ncols, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.5 * rows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, [*panels, *[None] * (rows * cols - len(panels))], strict=True):
        if panel is None:
            ax.set_axis_off()
            continue
        name, saliency = panel
        if image is not None:
            overlay(image, saliency, ax=ax, mean=mean, std=std, **kwargs)
        else:
            ax.imshow(_map_array(saliency, (saliency.shape[-2], saliency.shape[-1])), cmap=kwargs.get("cmap", "jet"))
            ax.set_axis_off()
        ax.set_title(name, fontsize=8)
    fig.suptitle(f"{result.mode.capitalize()} randomisation: each stage's map against the original", fontsize=10)
    return fig


def _number(value: float) -> str:
    """Two decimals, or "n/a" for NaN (the Spearman correlation of a constant map)."""
    return "n/a" if value != value else f"{value:.2f}"
