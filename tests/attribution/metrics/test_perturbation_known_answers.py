"""Deletion, insertion and ROAD against curves worked out from the pixel order, on non-square images.

The models make each curve point readable by hand: a linear model (deletion, insertion: the score is a sum over the
kept pixels) and a model that scores which pixels were imputed (ROAD: a removed pixel of an all-zero image becomes
non-zero noise), so that the number of pixels at each point, the most/least relevant end and the batch order show.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.metrics import deletion, deletion_insertion, insertion, road

H, W = 3, 5  # non-square: a swapped axis or a count rounded the wrong way changes the numbers


@pytest.fixture
def linear():
    """Images ``(2, 2, 3, 5)``, a linear classifier on them, maps with distinct values, all in float64."""
    torch.manual_seed(0)
    images = torch.randn(2, 2, H, W, dtype=torch.float64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * H * W, 3)).double().eval()
    maps = torch.randn(2, H, W, dtype=torch.float64)
    return model, images, maps


def order(maps: torch.Tensor) -> torch.Tensor:
    """Pixel indices of each map, most salient first (the maps' values are distinct)."""
    return torch.tensor([sorted(range(H * W), key=lambda p, m=m: -float(m.flatten()[p])) for m in maps])


def logit(model: nn.Module, x: torch.Tensor, classes: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(x)[torch.arange(len(x)), classes]


def by_hand(model, images, fill, maps, classes, counts):
    """``(B, points)``: the score with the ``counts[k]`` most salient pixels of each image taken from ``fill``."""
    ranked = order(maps)
    rows = []
    for b in range(len(images)):
        row = []
        for k in counts:
            x = images[b].clone().flatten(1)
            x[:, ranked[b, :k]] = fill[b].flatten(1)[:, ranked[b, :k]]
            row.append(logit(model, x.view(1, 2, H, W), [classes[b]])[0])
        rows.append(torch.stack(row))
    return torch.stack(rows)


def trapezoid(fractions: list[float], scores: torch.Tensor) -> torch.Tensor:
    return sum((fractions[i + 1] - fractions[i]) * (scores[:, i] + scores[:, i + 1]) / 2 for i in range(4))


COUNTS = [0, 3, 7, 11, 15]  # floor(k * 15 / 4), k = 0..4
FRACTIONS = [c / 15 for c in COUNTS]


def test_deletion_curve_is_the_score_with_the_top_pixels_zeroed(linear):
    model, images, maps = linear
    got = deletion(model, images, maps, [2, 0], steps=4, score="logit", batch_size=3)
    expected = by_hand(model, images, torch.zeros_like(images), maps, [2, 0], COUNTS)
    torch.testing.assert_close(got.fractions.double(), torch.tensor(FRACTIONS, dtype=torch.float64))
    torch.testing.assert_close(got.scores, expected)
    torch.testing.assert_close(got.auc, trapezoid(FRACTIONS, expected))


def test_insertion_curve_reveals_the_top_pixels_on_the_baseline(linear):
    model, images, maps = linear
    baseline = torch.linspace(-1, 2, 2 * H * W, dtype=torch.float64).view(1, 2, H, W)
    got = insertion(model, images, maps, [1, 2], baseline=baseline, steps=4, score="logit", batch_size=5)
    # revealing the k most salient pixels of the image = the image with all but those taken from the baseline
    ranked = order(maps)
    expected = torch.empty(2, 5, dtype=torch.float64)
    for b in range(2):
        for i, k in enumerate(COUNTS):
            x = baseline[0].clone().flatten(1)
            x[:, ranked[b, :k]] = images[b].flatten(1)[:, ranked[b, :k]]
            expected[b, i] = logit(model, x.view(1, 2, H, W), [[1, 2][b]])[0]
    torch.testing.assert_close(got.scores, expected)
    torch.testing.assert_close(got.auc, trapezoid(FRACTIONS, expected))


def test_deletion_insertion_shares_forwards_and_matches_the_separate_curves(linear):
    model, images, maps = linear
    fill = torch.full((1, 2, 1, 1), 0.25, dtype=torch.float64)
    removed, revealed = deletion_insertion(model, images, maps, [0, 1], baselines=(fill, fill), steps=4, score="logit")
    alone = deletion(model, images, maps, [0, 1], baseline=fill, steps=4, score="logit")
    inserted = insertion(model, images, maps, [0, 1], baseline=fill, steps=4, score="logit")
    torch.testing.assert_close(removed.scores, alone.scores)
    torch.testing.assert_close(revealed.scores, inserted.scores)


def test_tied_map_values_are_taken_in_raster_order(linear):
    """A map of ties (zeros after a ReLU) removes pixels row by row, left to right."""
    model, images, _ = linear
    maps = torch.zeros(2, H, W, dtype=torch.float64)
    maps[:, 2, 4] = 1.0  # the last pixel first, then the ties in raster order
    got = deletion(model, images, maps, [0, 0], steps=5, score="logit")
    expected = []
    for k in [0, 3, 6, 9, 12, 15]:
        x = images.clone().flatten(2)
        chosen = [14, *range(14)][:k]
        x[:, :, chosen] = 0
        expected.append(logit(model, x.view(2, 2, H, W), [0, 0]))
    torch.testing.assert_close(got.scores, torch.stack(expected, dim=1))


class Imputed(nn.Module):
    """Logits ``(B, 2)``: weighted counts of the pixels that are not 0 in some channel (the imputed ones)."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weights", weights)  # (2, pixels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        changed = (x != 0).any(dim=1).flatten(1).to(x.dtype)
        return changed @ self.weights.T


def test_road_removes_round_p_percent_of_the_pixels_from_each_end():
    """3x7 = 21 pixels: 10%, 60% and 90% are 2.1, 12.6 and 18.9 pixels, rounded to 2, 13 and 19.

    An all-zero image stays zero where it is kept and gets non-zero noise where pixels are imputed; the model
    sums a weight per imputed pixel, so each point tells which pixels were removed.
    """
    h, w = 3, 7
    torch.manual_seed(1)
    weights = torch.rand(2, h * w, dtype=torch.float64) + torch.arange(h * w) * 10.0 ** torch.arange(2)[:, None]
    model = Imputed(weights).eval()
    images = torch.zeros(2, 3, h, w, dtype=torch.float64)
    maps = torch.randn(2, h, w, dtype=torch.float64)
    got = road(model, images, maps, [1, 0], percentiles=[10, 60, 90], score="logit", batch_size=4)
    counts = [2, 13, 19]
    classes = [1, 0]
    ranked = torch.stack([torch.argsort(m.flatten(), descending=True) for m in maps])

    def summed(pixels: list[torch.Tensor]) -> torch.Tensor:  # (B, points) weights of the chosen pixels
        return torch.stack([torch.stack([weights[classes[b], p].sum() for p in row]) for b, row in enumerate(pixels)])

    morf = summed([[ranked[b, :k] for k in counts] for b in range(2)])
    lerf = summed([[ranked[b, h * w - k :] for k in counts] for b in range(2)])
    torch.testing.assert_close(got.morf, morf)
    torch.testing.assert_close(got.lerf, lerf)
    torch.testing.assert_close(got.score, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(got.auc, (lerf.mean(1) - morf.mean(1)) / 2)
