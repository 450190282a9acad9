"""The pictures of examples/perturbation_demo.py and examples/reference_demo.py, drawn from small made-up maps.

The examples themselves run in tests/test_examples.py; here their drawing functions alone: a colour bar for every
map, every number in a title said in words, no text under 8 pt.
"""

from __future__ import annotations

import importlib
import re

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.text import Text

perturbation_demo = importlib.import_module("examples.perturbation_demo")  # no model is loaded on import
reference_demo = importlib.import_module("examples.reference_demo")


def _sizes(fig: Figure) -> dict[str, float]:
    """``{text: font size in points}`` of every visible, non-empty text of the figure (after a draw)."""
    fig.canvas.draw()
    return {t.get_text(): t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()}


def test_every_perturbation_map_has_a_colour_bar_in_logit_units_and_no_text_is_below_8_points():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    maps = {"Occlusion": torch.randn(2, 3, 16, 16), "RISE": 5 + torch.rand(2, 3, 16, 16),
            "KernelSHAP (superpixels)": torch.randn(2, 3, 16, 16)}  # fmt: skip
    fig = perturbation_demo.draw_maps(images, ["a: one", "b: two"], maps)
    try:
        shown = [im for ax in fig.axes for im in ax.get_images() if isinstance(im, AxesImage)]
        heat = [im for im in shown if im.get_array().ndim == 2]  # the maps (the photos are RGB)
        assert len(heat) == 2 * len(maps)
        for im in heat:
            assert im.colorbar is not None
            assert im.colorbar.ax.get_ylabel() in perturbation_demo.UNITS.values()
        occlusion = heat[0]
        assert occlusion.colorbar.ax.get_ylabel() == perturbation_demo.UNITS["Occlusion"]
        assert occlusion.norm.vmin == -occlusion.norm.vmax  # symmetric: red raises the logit, blue lowers it
        sizes = _sizes(fig)
        assert {"Occlusion", "RISE", "a: one", perturbation_demo.UNITS["RISE"]} <= set(sizes)
        assert min(sizes.values()) >= 8, sizes
    finally:
        plt.close(fig)


def test_the_reference_maps_say_every_number_in_words_and_share_one_colour_bar():
    names = reference_demo.titles(4, 8)
    assert names[2] == "GradientShap\n4 references, 8 samples"
    for name in names:  # each number followed by what it counts
        assert not re.findall(r"\d+(?! (?:references|samples))", name), name
    torch.manual_seed(0)
    images, maps = torch.randn(2, 3, 16, 16), {name: torch.rand(2, 16, 16) for name in names}
    fig = reference_demo.side_by_side(images, maps, ["a: one", "b: two"])
    try:
        heat = [im for ax in fig.axes for im in ax.get_images() if im.get_array().ndim == 2]
        assert len(heat) == 2 * len(names) and sum(im.colorbar is not None for im in heat) == 1
        sizes = _sizes(fig)
        assert set(names) <= set(sizes) and min(sizes[name] for name in names) >= 9
        assert min(sizes.values()) >= 8, sizes
    finally:
        plt.close(fig)
