"""The pointing game and its energy-based form, worked out by hand, with TorchRay's tolerance rule."""

from __future__ import annotations

import pytest
import torch

from attribution.metrics import pointing_game


def peaked(points: list[tuple[int, int]], size: int = 40) -> torch.Tensor:
    maps = torch.zeros(len(points), size, size)
    for i, (row, col) in enumerate(points):
        maps[i, row, col] = 1.0
    return maps


def test_hits_by_box_with_and_without_tolerance():
    box = torch.tensor([10, 20, 20, 30])  # x1, y1, x2, y2: columns 10..19 of rows 20..29
    maps = peaked([(25, 15), (25, 20), (25, 34), (35, 15), (19, 9)])
    exact = pointing_game(maps, box.expand(5, 4), tolerance=0)
    assert exact.hit.tolist() == [True, False, False, False, False]
    assert exact.peak.tolist() == [[25, 15], [25, 20], [25, 34], [35, 15], [19, 9]]
    # TorchRay's rule: a hit when a region pixel lies closer than the tolerance (strictly)
    near = pointing_game(maps, box.expand(5, 4), tolerance=15)
    assert near.hit.tolist() == [True, True, False, True, True]  # col 34 is 15 from col 19: not closer than 15
    assert pointing_game(maps[2:3], box[None], tolerance=15.01).hit.tolist() == [True]
    assert exact.energy.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_energy_is_the_share_of_positive_mass_inside():
    maps = torch.zeros(1, 10, 10)
    maps[0, 0, 0] = 3.0  # inside
    maps[0, 9, 9] = 1.0  # outside
    maps[0, 5, 5] = -4.0  # negative values do not count
    result = pointing_game(maps, torch.tensor([[0, 0, 5, 5]]))
    assert result.energy.tolist() == [pytest.approx(0.75)]
    assert result.hit.tolist() == [True]


def test_masks_box_lists_and_single_maps_agree():
    maps = peaked([(5, 5), (30, 30)])
    masks = torch.zeros(2, 40, 40, dtype=torch.bool)
    masks[0, 0:10, 0:10] = True
    masks[1, 0:10, 0:10] = True
    masks[1, 28:40, 28:40] = True
    boxes = [torch.tensor([[0, 0, 10, 10]]), [[0, 0, 10, 10], [28, 28, 40, 40]]]  # a union of two boxes for item 1
    by_mask, by_boxes = pointing_game(maps, masks, tolerance=0), pointing_game(maps, boxes, tolerance=0)
    assert by_mask.hit.tolist() == by_boxes.hit.tolist() == [True, True]
    assert by_boxes.energy.tolist() == [1.0, 1.0]
    one = pointing_game(maps[1], [28.0, 28.0, 40.0, 40.0], tolerance=0)
    assert one.hit.tolist() == [True] and one.peak.tolist() == [[30, 30]]


def test_box_edges_follow_pixel_centres():
    maps = peaked([(0, 10), (0, 9)], size=12)
    result = pointing_game(maps, torch.tensor([[9.6, 0, 12, 12], [9.6, 0, 12, 12]]), tolerance=0)
    assert result.hit.tolist() == [True, False]  # column 10's centre 10.5 is inside, column 9's 9.5 is not


def test_constant_maps_miss_with_a_warning_and_errors_are_clear():
    with pytest.warns(UserWarning, match="constant: it points nowhere"):
        result = pointing_game(torch.zeros(1, 8, 8), torch.tensor([[0, 0, 8, 8]]))
    assert result.hit.tolist() == [False] and torch.isnan(result.energy).all()
    maps = torch.rand(2, 8, 8)
    with pytest.raises(ValueError, match="1 regions for 2 maps"):
        pointing_game(maps, [[0, 0, 4, 4]])
    with pytest.raises(ValueError, match="x2 <= x1"):
        pointing_game(maps, torch.tensor([[4, 0, 2, 4], [0, 0, 4, 4]]))
    with pytest.raises(ValueError, match=r"the region of item\(s\) \[1\] covers no pixel"):
        pointing_game(maps, torch.tensor([[0, 0, 4, 4], [20, 20, 30, 30]]))
    with pytest.raises(ValueError, match=r"masks must be \(B, H, W\)"):
        pointing_game(maps, torch.ones(2, 4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="`regions` must be boolean masks"):
        pointing_game(maps, "box")
