"""Pictures of the lens: a layers x positions grid of top tokens, and a layers x heads heatmap of direct effects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .logit_lens import top_tokens

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .dla import DirectLogitAttribution


def plot_logit_lens(
    lens: torch.Tensor,
    *,
    decode: Callable[[int], str] | Any = None,
    tokens: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    example: int = 0,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """The top token of every (layer, position) of one example, coloured by its probability.

    Args:
        lens: ``(layers, B, T, vocab)`` from :func:`attribution.logit_lens`.
        decode: a tokenizer (its ``decode``) or a function from a token id to its text; ``None``: the ids.
        tokens: the input tokens, as the positions' labels.
        layers: the rows' labels (default ``L0``, ``L1``, ...).
        example: which example of the batch.
        ax: the axes to draw on (else a new figure).
        title: the title.

    Returns:
        The axes.

    Example:
        >>> from attribution.lens import plot_logit_lens
        >>> ax = plot_logit_lens(torch.randn(3, 1, 4, 10), tokens=list("abcd"))
        >>> len(ax.texts)
        12
    """
    import matplotlib.pyplot as plt

    ids, probs = top_tokens(lens[:, example], 1)
    ids, probs = ids[..., 0], probs[..., 0]
    text = _decoder(decode)
    rows, cols = ids.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.9 * cols + 1.5), max(3.0, 0.32 * rows + 1.2)))
    image = ax.imshow(probs.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for r in range(rows):
        for c in range(cols):
            colour = "white" if probs[r, c] > 0.6 else "black"
            ax.text(c, r, text(int(ids[r, c]))[:10], ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(
        range(cols), list(tokens) if tokens is not None else [str(c) for c in range(cols)], rotation=45, ha="right"
    )
    ax.set_yticks(range(rows), list(layers) if layers is not None else [f"L{i}" for i in range(rows)])
    ax.set_xlabel("position (input token)")
    ax.set_ylabel("layer")
    ax.figure.colorbar(image, ax=ax, label="probability of the top token", fraction=0.03)
    ax.set_title(title or "logit lens: top token after each layer")
    return ax


def _decoder(decode: Any) -> Callable[[int], str]:
    if decode is None:
        return str
    method = getattr(decode, "decode", None)
    if callable(method):
        return lambda i: str(method([i])).replace("\n", "\\n")
    if callable(decode):
        return lambda i: str(decode(i))
    raise TypeError(f"`decode` must be a tokenizer or a function from a token id to text; got {type(decode).__name__}")


def plot_direct_logit_attribution(
    dla: DirectLogitAttribution,
    *,
    example: int | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    annotate: int = 5,
) -> Axes:
    """Every head's direct effect as a layers x heads heatmap (red: towards the direction, blue: against).

    Args:
        dla: from :func:`attribution.direct_logit_attribution` with ``components="heads"`` and an int position.
        example: which example; ``None``: the mean over the batch.
        ax: the axes to draw on (else a new figure).
        title: the title.
        annotate: how many of the strongest cells to write the value in.

    Returns:
        The axes.

    Example:
        >>> from attribution.lens import DirectLogitAttribution, plot_direct_logit_attribution
        >>> names = ["embed", "a0.h0", "a0.h1", "m0", "a1.h0", "a1.h1", "m1"]
        >>> dla = DirectLogitAttribution(names, torch.randn(7, 2), torch.zeros(2), torch.zeros(2), heads=2)
        >>> plot_direct_logit_attribution(dla).get_ylabel()
        'layer'
    """
    import matplotlib.pyplot as plt

    grid = dla.grid()
    if grid.dim() != 3:
        raise ValueError("plot_direct_logit_attribution needs one position: pass `positions` as an int")
    values = (grid.mean(-1) if example is None else grid[..., example]).float()
    layers, heads = values.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.45 * heads + 2.5), max(3.0, 0.22 * layers + 1.5)))
    limit = max(float(values.abs().max()), 1e-12)
    image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for i in values.abs().flatten().argsort(descending=True)[:annotate].tolist():
        r, c = divmod(i, heads)
        colour = "white" if abs(float(values[r, c])) > 0.6 * limit else "black"
        ax.text(c, r, f"{values[r, c]:+.2f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(heads), [f"H{h}" for h in range(heads)])
    ax.set_yticks(range(layers), [f"L{i}" for i in range(layers)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.figure.colorbar(image, ax=ax, label="direct effect on the logit (difference)", fraction=0.04)
    ax.set_title(
        title or "direct logit attribution of each head" + (" (mean over examples)" if example is None else "")
    )
    return ax
