"""The pure functions behind the metrics: pixel order, steps, baselines, imputation, rank correlation and SSIM.

Expected values are worked out by hand on tiny inputs (captum style) or, behind importorskip, taken from scipy and
scikit-image.
"""

from __future__ import annotations

import math

import pytest
import torch

from attribution._maps import average_ranks, spearman
from attribution.metrics._impute import linear_imputation, noisy_linear_imputation
from attribution.metrics._perturb import auc, blur, make_baseline, pixel_ranks, replace_top, step_counts
from attribution.metrics._similarity import ssim


def test_pixel_ranks_are_descending_with_ties_in_raster_order():
    maps = torch.tensor([[[0.9, 0.1], [0.5, 0.7]], [[0.0, 1.0], [0.0, 0.0]]])
    assert pixel_ranks(maps).tolist() == [[0, 3, 2, 1], [1, 0, 2, 3]]


def test_step_counts_are_floors_of_equal_shares():
    assert step_counts(4, 4).tolist() == [0, 1, 2, 3, 4]
    assert step_counts(10, 4).tolist() == [0, 2, 5, 7, 10]  # floor(k * 10 / 4)
    with pytest.raises(ValueError, match="`steps` must be an int from 1 to the number of pixels"):
        step_counts(4, 5)


def test_replace_top_takes_all_channels_of_the_top_pixels_from_the_fill():
    source = torch.arange(8.0).view(1, 2, 2, 2)  # channel 0: 0..3, channel 1: 4..7
    fill = -torch.ones(1, 2, 2, 2)
    ranks = torch.tensor([[2, 0, 3, 1]])  # pixel 1 first, then pixel 3
    out = replace_top(source, fill, ranks, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]))
    assert out[0].tolist() == source[0].tolist()
    assert out[1].flatten(1).tolist() == [[0, -1, 2, 3], [4, -1, 6, 7]]
    assert out[2].flatten(1).tolist() == [[0, -1, 2, -1], [4, -1, 6, -1]]
    assert source.flatten().tolist() == list(range(8))  # the source is not written to


def test_baselines():
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    assert make_baseline("zeros", images).abs().sum() == 0
    means = make_baseline("mean", images)
    torch.testing.assert_close(means[1, 2], torch.full((4, 4), float(images[1, 2].mean())))
    flat = torch.full((1, 3, 32, 32), 0.7)
    torch.testing.assert_close(blur(flat), flat)  # reflected borders: a constant image stays constant
    colour = make_baseline(torch.tensor([1.0, 2.0, 3.0])[:, None, None], images)
    assert colour.shape == images.shape and colour[1, 2, 3, 3] == 3
    assert make_baseline(lambda x: x * 2, images)[0, 0, 0, 1] == 2
    with pytest.raises(ValueError, match=r"`baseline` of shape \(2,\) does not broadcast"):
        make_baseline(torch.zeros(2), images)
    with pytest.raises(ValueError, match="`baseline` must be 'zeros', 'mean', 'blur'"):
        make_baseline("black", images)
    with pytest.raises(ValueError, match=r"more than 5 pixels a side; got \(4, 4\): pass baseline='zeros'"):
        make_baseline("blur", images)


def test_blur_is_the_rise_gaussian():
    impulse = torch.zeros(1, 1, 21, 21)
    impulse[0, 0, 10, 10] = 1
    kernel = blur(impulse)[0, 0, 5:16, 5:16]
    offsets = torch.arange(-5, 6, dtype=torch.float32)
    bell = torch.exp(-(offsets**2) / (2 * 5.0**2))
    torch.testing.assert_close(kernel, torch.outer(bell, bell) / bell.sum() ** 2)


def test_auc_is_the_trapezoid_rule():
    scores = torch.tensor([[10.0, 9, 5, 2, 0]])
    assert auc(torch.linspace(0, 1, 5), scores).item() == pytest.approx(0.25 * (9.5 + 7 + 3.5 + 1))


def test_imputation_of_one_pixel_is_the_weighted_mean_of_its_neighbours():
    image = torch.tensor([[0.0, 0, 0], [0, 9, 0], [0, 0, 6]]).view(1, 1, 3, 3)
    centre = torch.zeros(1, 3, 3, dtype=torch.bool)
    centre[0, 1, 1] = True
    out = linear_imputation(image.double(), centre)
    assert out[0, 0, 1, 1].item() == pytest.approx(6 / 12)  # only the corner (weight 1/12) is not zero
    corner = torch.zeros(1, 3, 3, dtype=torch.bool)
    corner[0, 2, 2] = True
    # a corner has 3 neighbours inside the image: the centre (1/12) and two edges (1/6): 9 * (1/12) / (5/12)
    assert linear_imputation(image.double(), corner)[0, 0, 2, 2].item() == pytest.approx(9 / 5)


def test_imputation_of_two_neighbouring_pixels_solves_their_system():
    image = torch.tensor([[12.0, 0.0], [100.0, 100.0]]).view(1, 1, 2, 2).double()
    removed = torch.tensor([[[False, False], [True, True]]])
    out = linear_imputation(image, removed)[0, 0]
    # x10 * 5/12 = 12/6 + 0/12 + x11/6 and x11 * 5/12 = 0/6 + 12/12 + x10/6, i.e. 5 x10 = 24 + 2 x11, 5 x11 = 12 + 2 x10
    assert out[1, 1].item() == pytest.approx(36 / 7)
    assert out[1, 0].item() == pytest.approx(48 / 7)
    assert out[0].tolist() == [12.0, 0.0]  # kept pixels are untouched


def test_imputation_of_a_large_region_is_harmonic_and_channels_are_independent():
    # a ramp is the weighted mean of its neighbours everywhere inside: imputing any region of it gives it back
    rows, cols = torch.meshgrid(torch.arange(40.0), torch.arange(40.0), indexing="ij")
    ramp = torch.stack([rows + 2 * cols, 3 - cols]).double()[None]
    removed = torch.zeros(1, 40, 40, dtype=torch.bool)
    removed[0, 5:35, 3:30] = True
    torch.testing.assert_close(linear_imputation(ramp, removed), ramp)
    assert linear_imputation(ramp.float(), removed).dtype == torch.float32


def test_imputation_in_chunks_equals_one_solve_per_image(monkeypatch):
    # the batch is solved a few images at a time; where it is cut must not matter, nor images with nothing removed
    from attribution.metrics import _impute

    torch.manual_seed(0)
    images = torch.randn(5, 2, 12, 12, dtype=torch.float64)
    removed = torch.rand(5, 12, 12) < torch.tensor([0.3, 0.0, 0.6, 0.9, 0.5])[:, None, None]
    alone = torch.cat([linear_imputation(images[i : i + 1], removed[i : i + 1]) for i in range(5)])
    monkeypatch.setattr(_impute, "_SOLVE_ELEMENTS", 2 * 2 * 12 * 12)  # chunks of 2, 2 and 1 images
    torch.testing.assert_close(linear_imputation(images, removed), alone, rtol=0, atol=1e-9)
    assert torch.equal(linear_imputation(images, removed)[1], images[1])  # nothing removed: unchanged


def test_imputation_noise_lands_on_removed_pixels_only_and_is_seeded():
    image = torch.zeros(2, 3, 32, 32)
    removed = torch.zeros(2, 32, 32, dtype=torch.bool)
    removed[:, 8:24, 8:24] = True
    noisy = noisy_linear_imputation(image, removed, noise=0.5, seeds=[1, 2])
    assert noisy[:, :, ~removed[0]].abs().max() == 0
    assert noisy[0, :, removed[0]].std().item() == pytest.approx(0.5, rel=0.1)
    again = noisy_linear_imputation(image[1:], removed[1:], noise=0.5, seeds=[2])
    torch.testing.assert_close(again[0], noisy[1])  # an image's noise does not depend on its batch


def test_imputation_rejects_removing_everything():
    with pytest.raises(ValueError, match="every pixel of an image is removed"):
        linear_imputation(torch.zeros(1, 1, 4, 4), torch.ones(1, 4, 4, dtype=torch.bool))


def test_average_ranks_and_spearman_by_hand():
    assert average_ranks(torch.tensor([[3.0, 1.0, 3.0, 2.0]])).tolist() == [[2.5, 0.0, 2.5, 1.0]]
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert spearman(a, a**3).item() == pytest.approx(1.0)
    assert spearman(a, -a).item() == pytest.approx(-1.0)
    # ranks (0, 1, 2, 3) against (1.5, 0, 3, 1.5): centred (-1.5, -.5, .5, 1.5) . (0, -1.5, 1.5, 0) = 1.5
    b = torch.tensor([[2.0, 1.0, 5.0, 2.0]])
    assert spearman(a, b).item() == pytest.approx(1.5 / math.sqrt(5 * 4.5))
    assert math.isnan(spearman(a, torch.zeros(1, 4)).item())


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    a, b = torch.rand(3, 50), torch.rand(3, 50)
    b[:, :20] = 0.0  # ties, as a ReLU makes
    expected = [stats.spearmanr(x.numpy(), y.numpy()).statistic for x, y in zip(a, b, strict=True)]
    torch.testing.assert_close(spearman(a, b), torch.tensor(expected, dtype=torch.float64))


def test_ssim_by_hand_and_against_scikit_image():
    a = torch.rand(2, 24, 24)
    torch.testing.assert_close(ssim(a, a), torch.ones(2, dtype=torch.float64))
    # constant maps c and d: mean term (2cd + C1) / (c^2 + d^2 + C1), the variance term is C2 / C2 = 1
    c, d, c1 = 0.2, 0.6, 0.01**2
    constant = ssim(torch.full((1, 12, 12), c), torch.full((1, 12, 12), d)).item()
    assert constant == pytest.approx((2 * c * d + c1) / (c * c + d * d + c1))
    metrics = pytest.importorskip("skimage.metrics")
    b = (a + 0.3 * torch.rand(2, 24, 24)).clamp(0, 1)
    expected = [
        metrics.structural_similarity(
            x.double().numpy(), y.double().numpy(), data_range=1, gaussian_weights=True, sigma=1.5,
            use_sample_covariance=False,
        )
        for x, y in zip(a, b, strict=True)
    ]  # fmt: skip
    torch.testing.assert_close(ssim(a, b), torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(torch.rand(1, 7, 7), torch.rand(1, 7, 7))
