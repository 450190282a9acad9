"""Parity with captum 0.9 in float64 on a small CNN and non-square images.

Tolerance ``rtol=1e-6``: captum accumulates every attribution in float32 (``torch.zeros(..., dtype=torch.float)`` in
``captum.attr._core.feature_ablation`` and ``shapley_value``) and returns float32, so its results carry float32
rounding (about 6e-8 relative per sum).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import FeatureAblation, Occlusion, ShapleyValues, ShapleyValueSampling

captum_attr = pytest.importorskip("captum.attr")
pytestmark = pytest.mark.peers

FLOAT32_SUMS = {"rtol": 1e-6, "atol": 1e-7, "check_dtype": False}


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 5, 5)
    ).double().eval()  # fmt: skip


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 6, 10, dtype=torch.float64)
    base = torch.randn(1, 3, 6, 10, dtype=torch.float64)
    mask = (torch.arange(6)[:, None] // 3 * 3 + torch.arange(10)[None] // 4).view(1, 1, 6, 10)  # 6 regions
    return x, base, mask


@pytest.mark.parametrize(("window", "stride"), [((3, 2, 3), (3, 2, 2)), ((1, 4, 4), (1, 3, 3)), ((3, 6, 10), 1)])
def test_occlusion(model, inputs, window, stride):
    x, base, _ = inputs
    expected = captum_attr.Occlusion(model).attribute(
        x, sliding_window_shapes=window, strides=stride, baselines=base, target=[1, 3]
    )
    got = Occlusion(model, window, stride, base[0])(x, target=[1, 3])
    torch.testing.assert_close(got, expected, **FLOAT32_SUMS)


def test_feature_ablation(model, inputs):
    x, base, mask = inputs
    expected = captum_attr.FeatureAblation(model).attribute(x, baselines=base, target=2, feature_mask=mask)
    torch.testing.assert_close(FeatureAblation(model, mask, base)(x, target=2), expected, **FLOAT32_SUMS)
    per_element = captum_attr.FeatureAblation(model).attribute(x, target=0, perturbations_per_eval=30)
    torch.testing.assert_close(FeatureAblation(model)(x, target=0), per_element, **FLOAT32_SUMS)


def test_shapley_values(model, inputs):
    x, base, mask = inputs
    mask = mask // 2  # 3 features: captum runs 3! x 3 forwards
    expected = captum_attr.ShapleyValues(model).attribute(x, baselines=base, target=4, feature_mask=mask)
    torch.testing.assert_close(ShapleyValues(model, mask, base)(x, target=4), expected, **FLOAT32_SUMS)


def test_shapley_value_sampling_with_captums_permutations(model, inputs):
    x, base, mask = inputs
    torch.manual_seed(11)  # captum draws torch.randperm(M) from the global generator: seed=11 draws the same
    expected = captum_attr.ShapleyValueSampling(model).attribute(
        x, baselines=base, target=0, feature_mask=mask, n_samples=6
    )
    got = ShapleyValueSampling(model, mask, base, samples=6, seed=11)(x, target=0)
    torch.testing.assert_close(got, expected, **FLOAT32_SUMS)
