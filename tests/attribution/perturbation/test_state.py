"""Bad input gets an error naming what was expected and what came; every call leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import LIME, RISE, FeatureAblation, KernelSHAP, Occlusion, ShapleyValues, ShapleyValueSampling

from ...support import hook_state


class Net(nn.Module):
    """Conv -> BatchNorm -> dropout -> linear; ``fail`` raises inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(3 * 4 * 5, 3)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("stop")
        return self.fc(self.drop(self.norm(self.conv(x))).flatten(1))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    model = Net().double().train()  # train mode on purpose: calls run in eval and restore it
    model.conv.weight.requires_grad_(False)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    return model


def methods(model: nn.Module) -> list:
    mask = torch.arange(20).view(1, 4, 5) // 5
    return [
        Occlusion(model, (2, 2, 2), 1),
        FeatureAblation(model, mask),
        ShapleyValues(model, mask),
        ShapleyValueSampling(model, mask, samples=2),
        KernelSHAP(model, mask, samples=5),
        LIME(model, mask, samples=5),
        RISE(model, masks=4, cell=2),
    ]


def snapshot(model: nn.Module) -> dict:
    return {
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "hooks": hook_state(model),
        "grad_mode": torch.is_grad_enabled(),
    }


def assert_same(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for key in ("training", "requires_grad", "hooks", "grad_mode"):
        assert after[key] == before[key], key
    assert all(a is b for a, b in zip(after["grads"], before["grads"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after["buffers"], before["buffers"], strict=True))


@pytest.mark.parametrize("index", range(7))
def test_the_model_is_left_as_found_also_when_it_raises(net, index):
    x = torch.randn(2, 2, 4, 5, dtype=torch.float64)
    method = methods(net)[index]
    before = snapshot(net)
    first = method(x, target=1)
    assert first.shape == x.shape
    assert_same(net, before)
    torch.testing.assert_close(method(x, target=1), first)  # eval mode: dropout off, batch norm not updated
    net.fail = True
    with pytest.raises(RuntimeError, match="stop"):
        method(x, target=1)
    assert_same(net, before)


# -- bad input ----------------------------------------------------------------------------------------------------
def test_a_feature_mask_that_does_not_broadcast_names_both_shapes(net):
    with pytest.raises(ValueError, match=r"shape \(3, 4\) does not broadcast to one item of shape \(2, 4, 5\)"):
        FeatureAblation(net, torch.zeros(3, 4, dtype=torch.long))(torch.randn(1, 2, 4, 5, dtype=torch.float64))


def test_a_feature_mask_with_missing_ids_names_them(net):
    mask = torch.tensor([0, 0, 2, 2, 5]).view(1, 1, 5)
    with pytest.raises(ValueError, match=r"ids \[1, 3, 4\] are missing"):
        FeatureAblation(net, mask)(torch.randn(1, 2, 4, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="integer feature ids"):
        FeatureAblation(net, mask.float())(torch.randn(1, 2, 4, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("window", "stride", "message"),
    [
        ((2, 2), 1, r"one positive size per dimension of an item of shape \(2, 4, 5\)"),
        ((1, 5, 2), 1, r"`window` \(1, 5, 2\) is larger than an item of shape \(2, 4, 5\)"),
        ((1, 2, 2), (1, 1), r"`stride` \(1, 1\) must give one positive size per dimension of an item of shape"),
        ((1, 2, 2), (1, 3, 1), r"`stride` \(1, 3, 1\) is larger than `window` \(1, 2, 2\)"),
    ],
)
def test_an_occlusion_window_or_stride_that_does_not_fit_names_both_shapes(net, window, stride, message):
    with pytest.raises(ValueError, match=message):
        Occlusion(net, window, stride)(torch.randn(1, 2, 4, 5, dtype=torch.float64))


def test_exact_shapley_above_ten_features_names_the_sampling_method(net):
    with pytest.raises(ValueError, match="ShapleyValueSampling"):
        ShapleyValues(net)(torch.randn(1, 2, 4, 5, dtype=torch.float64))


def test_a_baseline_of_the_wrong_shape_names_both_shapes(net):
    with pytest.raises(ValueError, match=r"shape \(4, 5\), but `inputs` are \(1, 2, 4, 5\)"):
        FeatureAblation(net, baseline=torch.zeros(4, 5))(torch.randn(1, 2, 4, 5, dtype=torch.float64))


def test_uint8_images_get_the_conversion_error_of_the_cams():
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(TypeError, match=r"Convert with `images.float\(\) / 255`"):
        Occlusion(model, (3, 2, 2))(torch.zeros(1, 3, 6, 6, dtype=torch.uint8))


def test_nan_scores_under_perturbation_are_reported_with_the_items_and_never_averaged_in(net):
    class Fragile(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            broken = (x[:, 0] == 0) & (x[:, 3] == 2)  # item 1 (its last input is 2) breaks when feature 0 goes
            return torch.where(broken[:, None], torch.nan, x.sum(1, keepdim=True).expand(-1, 2))

    x = torch.ones(3, 4, dtype=torch.float64)
    x[1, 3] = 2
    with pytest.warns(UserWarning, match=r"NaN for item\(s\) \[1\] under 1 perturbation"):
        got = FeatureAblation(Fragile())(x, target=0)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2]]).any()


def test_bad_settings_are_refused_at_construction(net):
    with pytest.raises(ValueError, match="`perturbations_per_forward`"):
        FeatureAblation(net, perturbations_per_forward=0)
    with pytest.raises(ValueError, match="`samples`"):
        ShapleyValueSampling(net, samples=0)
    with pytest.raises(ValueError, match="`p`"):
        RISE(net, p=0)
