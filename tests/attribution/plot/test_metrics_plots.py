"""Plots of the metrics: rendered to PNG and checked pixel by pixel."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from attribution.metrics import CurveResult, RandomizationResult
from attribution.plot import plot_curves, plot_randomization
from tests.support import render

BLUE = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's first line colour, C0
ORANGE = np.array([0xFF, 0x7F, 0x0E]) / 255  # C1


def curve(kind: str, scores: list[list[float]]) -> CurveResult:
    values = torch.tensor(scores)
    fractions = torch.linspace(0, 1, values.shape[1])
    return CurveResult(kind, fractions, values, torch.trapezoid(values, fractions, dim=1))


def test_curves_are_drawn_where_their_scores_are():
    fig, ax = plt.subplots(figsize=(4, 4))
    fig.subplots_adjust(0, 0, 1, 1)
    falling = curve("deletion", [[1.0, 0.0], [0.0, 0.0]])  # item 0 falls from 1 to 0
    flat = curve("deletion", [[0.25, 0.25], [0.75, 0.75]])
    assert plot_curves({"falling": falling, "flat": flat}, ax=ax, legend=False) is ax
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    pixels = render(fig)  # 200 x 200
    assert np.abs(pixels[100, 100] - BLUE).max() < 0.1  # the middle of the falling diagonal
    assert np.abs(pixels[150, 60] - ORANGE).max() < 0.1  # 0.25 from the bottom, all the way across
    assert np.abs(pixels[150, 140] - ORANGE).max() < 0.1
    assert pixels[50, 60].min() > 0.9  # above both lines: background


def test_curve_labels_axes_and_the_mean_over_the_batch():
    results = {"a": curve("insertion", [[0.0, 1.0], [0.0, 0.5]]), "b": curve("insertion", [[0.2, 0.2], [0.4, 0.4]])}
    ax = plot_curves(results, item=None, title="insertion")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a (AUC 0.375)", "b (AUC 0.300)"]  # the areas' means over the two images
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.0, 0.75])
    assert ax.get_xlabel() == "share of pixels revealed" and ax.get_title() == "insertion"
    plt.close(ax.figure)
    mixed = plot_curves({"del": curve("deletion", [[1.0, 0.0]]), "ins": curve("insertion", [[0.0, 1.0]])})
    assert mixed.get_xlabel() == "share of pixels perturbed"
    plt.close(mixed.figure)
    with pytest.raises(ValueError, match="`item` 2 is out of range for a batch of 2"):
        plot_curves(results, item=2)


def test_randomization_grid_shows_each_stage_with_its_scores():
    original = torch.zeros(1, 16, 16)
    original[0, :8, :8] = 1.0  # hot top-left
    moved = torch.zeros(2, 1, 16, 16)
    moved[0, 0, :8, 8:] = 1.0  # stage 0: hot top-right
    moved[1, 0, 8:, 8:] = 1.0  # stage 1: hot bottom-right
    result = RandomizationResult(
        "cascading", ["fc", "layer4"], original, moved, torch.tensor([[0.5], [-0.25]]), torch.tensor([[0.4], [0.1]])
    )
    fig = plot_randomization(result, ncols=2)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["original", "fc\nSpearman 0.50, SSIM 0.40", "up to layer4\nSpearman -0.25, SSIM 0.10", ""]
    assert not fig.axes[3].images  # the unused fourth panel of the 2 x 2 grid is empty
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    lowest_above = min(ax.get_window_extent(renderer).y0 for ax in fig.axes[:2])
    assert fig.axes[2].title.get_window_extent(renderer).y1 <= lowest_above  # titles clear the panels above
    for ax in fig.axes[:3]:
        ax.set_title("")
    fig.set_layout_engine("none")
    for i, ax in enumerate(fig.axes):  # each panel fills its quadrant
        ax.set_position([i % 2 / 2, 0.5 - i // 2 / 2, 0.5, 0.5])
    fig.set_size_inches(4, 4)
    pixels = render(fig)  # 200 x 200: panels of 100 x 100, each map's quadrants 50 x 50
    hot, cold = np.array([0.5, 0.0, 0.0]), np.array([0.0, 0.0, 0.5])  # jet's ends
    assert np.abs(pixels[25, 25] - hot).max() < 0.1 and np.abs(pixels[75, 75] - cold).max() < 0.1  # original
    assert np.abs(pixels[25, 175] - hot).max() < 0.1 and np.abs(pixels[25, 125] - cold).max() < 0.1  # stage 0
    assert np.abs(pixels[175, 75] - hot).max() < 0.1 and np.abs(pixels[125, 25] - cold).max() < 0.1  # stage 1


def test_randomization_grid_over_the_image():
    rho = torch.tensor([[0.0, float("nan")]])  # a constant map has no rank correlation
    result = RandomizationResult("independent", ["fc"], torch.rand(2, 8, 8), torch.rand(1, 2, 8, 8), rho, rho * 0)
    fig = plot_randomization(result, torch.rand(3, 32, 32), item=1, alpha=0.3)
    assert [ax.get_title() for ax in fig.axes] == ["original", "fc\nSpearman n/a, SSIM n/a"]
    assert fig.axes[0].images[-1].get_alpha() == 0.3 and len(fig.axes[0].images) == 2  # the photo, then the map
    plt.close(fig)
    with pytest.raises(ValueError, match="`item` 2 is out of range"):
        plot_randomization(result, item=2)
