"""Plots: rendered to PNG with Agg and checked pixel by pixel, not only for the absence of errors."""

from __future__ import annotations

import subprocess
import sys

import matplotlib
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from attribution.plot import compare, overlay, plot_patching, show_batch, show_tokens, to_rgb
from tests.support import DATA, render

matplotlib.use("Agg")


def test_overlay_puts_the_hot_region_where_the_map_is_hot():
    image = torch.full((3, 64, 64), 0.5)
    saliency = torch.zeros(8, 8)
    saliency[:4, :4] = 1.0  # hot top-left quadrant, at a coarser resolution than the image
    fig, ax = plt.subplots(figsize=(4, 4))
    fig.subplots_adjust(0, 0, 1, 1)
    assert overlay(image, saliency, ax=ax, cmap="jet", alpha=0.6) is ax
    pixels = render(fig)
    assert pixels.shape == (200, 200, 3)  # 4 in x 50 dpi
    top_left, bottom_right = pixels[20:80, 20:80], pixels[120:180, 120:180]
    # jet's ends are dark red (0.5, 0, 0) and dark blue (0, 0, 0.5), blended at 60% over the 0.5 grey
    np.testing.assert_allclose(top_left.mean((0, 1)), [0.5, 0.2, 0.2], atol=0.02)
    np.testing.assert_allclose(bottom_right.mean((0, 1)), [0.2, 0.2, 0.5], atol=0.02)


def test_overlay_undoes_normalisation_and_adds_contour_and_colorbar():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.2, 0.2)
    rgb = torch.rand(3, 16, 16)
    normalised = (rgb - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    np.testing.assert_allclose(to_rgb(normalised, mean, std), rgb.permute(1, 2, 0).numpy(), atol=1e-6)
    ax = overlay(normalised, torch.rand(4, 4), mean=mean, std=std, contour=True, colorbar=True, title="t")
    assert len(ax.figure.axes) == 2 and ax.get_title() == "t"
    assert ax.collections  # the contour lines
    plt.close(ax.figure)


def test_batch_grid_and_method_comparison():
    images, maps = torch.rand(5, 3, 16, 16), torch.rand(5, 4, 4)
    fig = show_batch(images, maps, ncols=3, titles=list("abcde"))
    assert len(fig.axes) == 6 and [a.get_title() for a in fig.axes[:5]] == list("abcde")
    assert not fig.axes[5].axison and not fig.axes[5].images
    plt.close(fig)
    fig = compare(images[0], {"Grad-CAM": maps[0], "rollout": maps[1]})
    assert [a.get_title() for a in fig.axes] == ["image", "Grad-CAM", "rollout"]
    plt.close(fig)
    with pytest.raises(ValueError, match="must match"):
        show_batch(images, maps[:4])


def test_patching_heatmap_is_centred_at_zero_with_token_labels():
    result = torch.tensor([[0.2, -1.0, 0.0], [0.5, 0.1, 0.0]])
    ax = plot_patching(result, tokens=["The", "cat", "sat"], title="resid")
    image = ax.images[0]
    assert image.get_clim() == (-1.0, 1.0) and image.get_cmap().name == "RdBu_r"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", "cat", "sat"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["L0", "L1"]
    pixels = render(ax.figure)
    assert pixels.shape[0] > 0
    heads = plot_patching(torch.randn(2, 3, 4))  # (layers, positions, heads): one row per layer and head
    assert [t.get_text() for t in heads.get_yticklabels()][:5] == ["L0.H0", "L0.H1", "L0.H2", "L0.H3", "L1.H0"]
    plt.close(heads.figure)
    with pytest.raises(ValueError, match="2 `tokens` for 3 columns"):
        plot_patching(result, tokens=["a", "b"])


def test_patching_heatmap_colours_match_the_values():
    fig, ax = plt.subplots(figsize=(3, 1))
    fig.subplots_adjust(0, 0, 1, 1)
    plot_patching(torch.tensor([[1.0, 0.0, -1.0]]), ax=ax, colorbar=False)
    ax.set_axis_off()
    pixels = render(fig)
    left, middle, right = pixels[25, 10], pixels[25, 75], pixels[25, 140]
    assert left[0] > left[2] + 0.2  # +1: RdBu_r's dark red
    assert right[2] > right[0] + 0.3  # -1: its dark blue
    assert middle.min() > 0.9  # 0: white


def test_token_relevance_colours():
    ax = show_tokens(["a", "b", "c"], torch.tensor([0.0, 1.0, 0.5]), cmap="Reds")
    colours = [t.get_bbox_patch().get_facecolor() for t in ax.texts]
    assert [t.get_text() for t in ax.texts] == ["a", "b", "c"]
    assert colours[1][1] < colours[2][1] < colours[0][1]  # Reds: darker (less green) is more relevant
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="3 tokens but 2 relevance values"):
        show_tokens(["a", "b", "c"], [0.1, 0.2])


@pytest.mark.slow
def test_matplotlib_is_imported_only_by_the_plotting_functions():
    code = "import sys, attribution, attribution.plot; print('matplotlib' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=DATA.parents[1]
    )
    assert result.stdout.strip() == "False"


def test_input_forms_and_nan_cells():
    rgb = np.random.default_rng(0).random((3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(to_rgb(rgb), rgb.transpose(1, 2, 0))  # channel-first numpy
    np.testing.assert_allclose(to_rgb(torch.as_tensor(rgb)[None]), rgb.transpose(1, 2, 0))  # a batch of one
    np.testing.assert_allclose(to_rgb(torch.full((3, 4, 4), 255, dtype=torch.uint8)), np.ones((4, 4, 3)))
    fig = show_batch(np.random.rand(2, 3, 8, 8), np.random.rand(2, 4, 4))
    plt.close(fig)
    with pytest.raises(TypeError, match="draws a figure of its own"):
        compare(torch.rand(3, 8, 8), {"a": torch.rand(4, 4)}, ax=None)
    ax = plot_patching(np.array([[1.0, float("nan"), -0.5]]))
    assert ax.images[0].get_clim() == (-1.0, 1.0)
    plt.close(ax.figure)
