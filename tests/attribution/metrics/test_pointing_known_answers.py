"""The pointing game on non-square maps: peaks, distances and energies worked out by hand."""

from __future__ import annotations

import pytest
import torch

from attribution.metrics import pointing_game


def maps_3x7() -> torch.Tensor:
    """Two 3x7 maps: the peak of the first at (row 2, col 5), of the second at (row 0, col 6); other values < 1."""
    maps = torch.linspace(-0.5, 0.5, 2 * 3 * 7).view(2, 3, 7).flip(-1)
    maps[0, 2, 5] = 2.0
    maps[1, 0, 6] = 3.0
    return maps


def test_peak_is_row_and_column_of_the_maximum_on_a_non_square_map():
    result = pointing_game(maps_3x7(), torch.tensor([[5, 2, 6, 3], [6, 0, 7, 1]]), tolerance=0)
    assert result.peak.tolist() == [[2, 5], [0, 6]]
    assert result.hit.tolist() == [True, True]


def test_tall_maps_too():
    maps = maps_3x7().transpose(1, 2).contiguous()  # 7x3: the peaks at (5, 2) and (6, 0)
    result = pointing_game(maps, torch.tensor([[2, 5, 3, 6], [0, 6, 1, 7]]), tolerance=0)
    assert result.peak.tolist() == [[5, 2], [6, 0]]
    assert result.hit.tolist() == [True, True]


@pytest.mark.parametrize(("tolerance", "hit"), [(0, False), (1.9, False), (2.0, False), (2.01, True)])
def test_tolerance_is_a_strict_euclidean_distance(tolerance, hit):
    """Region: the single pixel (row 2, col 6), 2 rows below the second map's peak (0, 6): a hit beyond 2 pixels."""
    regions = torch.zeros(2, 3, 7, dtype=torch.bool)
    regions[0, 0, 0] = True  # far from (2, 5): sqrt(4 + 25) pixels
    regions[1, 2, 6] = True
    result = pointing_game(maps_3x7(), regions, tolerance=tolerance)
    assert result.hit.tolist() == [False, hit]


def test_diagonal_distance_uses_rows_and_columns():
    """Region (row 1, col 3) is sqrt(1 + 4) = 2.24 pixels from the peak (2, 5) of the first map."""
    regions = torch.zeros(2, 3, 7, dtype=torch.bool)
    regions[:, 1, 3] = True
    assert pointing_game(maps_3x7(), regions, tolerance=2.2).hit.tolist() == [False, False]
    assert pointing_game(maps_3x7(), regions, tolerance=2.3).hit.tolist() == [True, False]


def test_energy_is_the_positive_mass_inside_the_box():
    maps = maps_3x7()
    boxes = torch.tensor([[1, 0, 4, 2], [0, 1, 7, 3]])  # cols 1..3 of rows 0..1; all cols of rows 1..2
    result = pointing_game(maps, boxes)
    positive = maps.clamp(min=0)
    inside = torch.stack([positive[0, 0:2, 1:4].sum(), positive[1, 1:3, :].sum()])
    torch.testing.assert_close(result.energy, inside / positive.sum(dim=(1, 2)))
