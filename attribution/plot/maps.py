"""Saliency maps over images, and token relevance for text models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._maps import map_array, to_rgb

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
    heat = map_array(saliency, rgb.shape[:2])
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
