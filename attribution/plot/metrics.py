"""The metrics' deletion and insertion curves and the randomisation test's grid of maps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._maps import map_array
from .maps import overlay

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ..metrics import CurveResult, RandomizationResult


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
            ax.imshow(map_array(saliency, (saliency.shape[-2], saliency.shape[-1])), cmap=kwargs.get("cmap", "jet"))
            ax.set_axis_off()
        ax.set_title(name, fontsize=8)
    fig.suptitle(f"{result.mode.capitalize()} randomisation: each stage's map against the original", fontsize=10)
    return fig


def _number(value: float) -> str:
    """Two decimals, or "n/a" for NaN (the Spearman correlation of a constant map)."""
    return "n/a" if value != value else f"{value:.2f}"
