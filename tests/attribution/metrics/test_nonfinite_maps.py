"""Metrics never score NaN as a result: NaN images, NaN maps and all-NaN randomisation maps warn, naming items."""

from __future__ import annotations

import pytest
import torch

from attribution.metrics import deletion, pointing_game, randomization_test


def test_pointing_game_nan_pixel_is_never_the_peak():
    maps = torch.zeros(3, 6, 10)
    maps[:, 1, 8] = 1.0  # the true peak, in the box of every item
    maps[1, 5, 0] = float("nan")
    boxes = torch.tensor([[6, 0, 10, 3]] * 3)
    with pytest.warns(UserWarning, match=r"item\(s\) \[1\] holds NaN"):
        result = pointing_game(maps, boxes, tolerance=0)
    assert result.hit.tolist() == [True, False, True]
    assert result.energy[1].isnan() and result.energy[[0, 2]].tolist() == [1.0, 1.0]
    assert result.peak[0].tolist() == [1, 8]


def test_randomization_all_nan_maps_are_not_a_perfect_correlation(tiny_cnn):
    def method(model, x, target):
        out = model(x)[torch.arange(len(x)), 0].sum()
        maps = torch.ones(len(x), 12, 12) * out.detach()
        maps[0] = float("nan")
        maps[1] += torch.arange(144.0).view(12, 12)
        return maps

    with pytest.warns(UserWarning, match=r"item\(s\) \[0\] hold NaN") as seen:
        result = randomization_test(method, tiny_cnn, torch.rand(2, 3, 12, 12), 0)
    assert not any("constant" in str(w.message) for w in seen)
    assert bool(result.spearman[:, 0].isnan().all())
    assert bool((result.spearman[:, 1] == 1).all())


def test_deletion_on_a_nan_image_warns_naming_the_item(tiny_cnn):
    images = torch.rand(2, 3, 8, 8)
    images[0, 1, 2, 2] = float("nan")
    maps = torch.rand(2, 8, 8)
    with pytest.warns(UserWarning, match=r"item\(s\) \[0\] score NaN or inf"):
        result = deletion(tiny_cnn, images, maps, 0, steps=4)
    assert bool(torch.isfinite(result.scores[1]).all())


def test_empty_batches_and_uint8_images_are_refused_saying_why(tiny_cnn):
    with pytest.raises(ValueError, match=r"empty batch \(0, 3, 8, 8\)"):
        deletion(tiny_cnn, torch.rand(0, 3, 8, 8), torch.rand(0, 8, 8), 0, steps=4)
    with pytest.raises(TypeError, match=r"uint8 images .*images.float\(\) / 255"):
        deletion(tiny_cnn, torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), torch.rand(2, 8, 8), 0, steps=4)
