"""Plots of attribution-patching estimates against exact patching, and of path patching: rendered to PNG and
checked where the marks land and in which colour."""

from __future__ import annotations

import matplotlib
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from attribution.plot import plot_atp_vs_exact, plot_path_patching
from tests.support import render

matplotlib.use("Agg")


def blue_points(pixels: np.ndarray) -> np.ndarray:
    """(row, column) of the scatter's blue (tab:blue, 70% opaque) pixels: not white, grey or black."""
    return np.argwhere(pixels[..., 2] - pixels[..., 0] > 0.2)


def test_points_on_the_diagonal_where_the_estimate_is_exact():
    exact = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    estimate = exact.clone()
    estimate[1, 2] = 0.0  # one cell badly underestimated
    fig, ax = plt.subplots(figsize=(4, 4))
    fig.subplots_adjust(0.1, 0.1, 0.9, 0.9)
    plot_atp_vs_exact(estimate, exact, tokens=["a", "b", "c"], ax=ax, annotate=2, title="t")
    assert ax.get_title() == "t" and ax.get_xlabel() == "exact activation patching"
    assert [t.get_text() for t in ax.texts] == ["L1 c", "L0 a"]  # the largest |exact - median|: 5 (L1 c) and 0
    legend = ax.get_legend().get_texts()[0].get_text()
    assert legend.startswith("cells (Spearman 0.") and "Pearson" in legend
    ax.set_xlim(-1, 6)
    ax.set_ylim(-1, 6)
    ax.get_legend().remove()
    for text in list(ax.texts):
        text.remove()
    pixels = render(fig)  # 200 x 200; the axes span 20..180 in both directions for -1..6
    points = blue_points(pixels)

    def near(x: float, y: float) -> bool:
        column, row = 20 + (x + 1) / 7 * 160, 180 - (y + 1) / 7 * 160
        return bool((np.abs(points - [row, column]).max(axis=1) <= 3).any())

    assert all(near(v, v) for v in [0.0, 1.0, 2.0, 3.0, 4.0])  # on the diagonal
    assert near(5.0, 0.0) and not near(5.0, 5.0)  # the underestimated cell, below it


def test_scatter_labels_heads_and_refuses_other_shapes():
    ax = plot_atp_vs_exact(torch.zeros(2, 3, 4), torch.arange(24.0).view(2, 3, 4), annotate=1)
    assert [t.get_text() for t in ax.texts] == ["L1.H3 2"]  # (layer, position, head)
    plt.close(ax.figure)
    with pytest.raises(ValueError, match=r"`estimate` \(2, 3\) and `exact` \(3, 2\) must have the same shape"):
        plot_atp_vs_exact(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="2 `tokens` for 3 columns"):
        plot_atp_vs_exact(torch.zeros(2, 3), torch.zeros(2, 3), tokens=["a", "b"])


def test_path_bars_point_the_right_way_in_the_right_colour():
    path = torch.tensor([0.8, -0.4, 0.1])
    total = torch.tensor([1.0, -0.5, 0.9])
    fig, ax = plt.subplots(figsize=(4, 3))
    fig.subplots_adjust(0, 0, 1, 1)
    plot_path_patching(path, total, layers=["a", "b", "c"], ax=ax)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "total effect",
        "through the receivers (+)",
        "through the receivers (-)",
    ]
    ax.get_legend().remove()
    ax.set_xlim(-1, 1)
    ax.set_axis_off()
    pixels = render(fig)  # 200 x 150; rows a, b, c from the top; x = -1..1 over 0..200
    row_a, row_b = 150 * (0.5 / 3), 150 * (1.5 / 3)

    def colour(x: float, row: float) -> np.ndarray:
        return pixels[int(row), int(100 + x * 100)]

    red, blue = colour(0.5, row_a), colour(-0.2, row_b)
    assert red[0] > red[2] + 0.3 and blue[2] > blue[0] + 0.3  # positive: red; negative: blue
    assert colour(-0.5, row_a).min() > 0.9 and colour(0.3, row_b).min() > 0.9  # nothing on the other side
    # beyond the path bar but within the total: the total's outline only, background inside
    assert colour(0.9, row_a).min() > 0.9


def test_path_top_cells_strongest_first():
    path = torch.tensor([[0.1, -0.9], [0.5, 0.0]])  # (senders, heads)
    ax = plot_path_patching(path, top=2, tokens=["H0", "H1"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["L0 H1", "L1 H0"]
    plt.close(ax.figure)
    with pytest.raises(ValueError, match=r"`total` \(3,\) must have the shape of `path` \(2, 2\)"):
        plot_path_patching(path, torch.zeros(3))
