"""The randomisation test: which layers each stage has re-initialised, in which order, and when SSIM applies.

The method under test reads the copy it is given and writes into its map which layers differ from the original
model, so each stage's map shows exactly which layers the stage randomised (cascading: all up to it; independent:
its own only).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution.metrics import randomization_test

LAYERS = ["0", "2", "4"]  # input to output


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 1), nn.Flatten(), nn.Linear(3 * 12 * 13, 4)
    ).eval()


def marking(original: nn.Module, size: tuple[int, int]):
    """A method whose map is a fixed ramp plus, in row 0, 10 at column ``i`` when layer ``LAYERS[i]`` differs."""

    def method(model: nn.Module, inputs: torch.Tensor, target) -> torch.Tensor:
        ramp = torch.arange(size[0] * size[1], dtype=torch.float32).view(size) / 100
        maps = ramp.expand(len(inputs), *size).clone()
        for i, name in enumerate(LAYERS):
            if not torch.equal(model.get_submodule(name).weight, original.get_submodule(name).weight):
                maps[:, 0, i] += 10
        return maps

    return method


def changed(maps: torch.Tensor) -> list[list[str]]:
    """For each stage, the layers its map says were randomised."""
    return [[name for i, name in enumerate(LAYERS) if bool((stage[:, 0, i] >= 10).all())] for stage in maps]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("cascading", [["4"], ["2", "4"], ["0", "2", "4"]]), ("independent", [["4"], ["2"], ["0"]])],
)
def test_stages_go_from_the_output_to_the_input(mode, expected):
    model = make_model()
    result = randomization_test(marking(model, (12, 13)), model, torch.randn(2, 2, 12, 13), [0, 1], mode=mode)
    assert result.stages == ["4", "2", "0"]
    assert changed(result.maps) == expected
    assert changed(result.original[None]) == [[]]


def test_layers_given_in_any_order_are_randomised_from_the_output():
    model = make_model()
    method = marking(model, (12, 13))
    result = randomization_test(method, model, torch.randn(2, 2, 12, 13), [0, 1], layers=["0", "4"])
    assert result.stages == ["4", "0"]
    assert changed(result.maps) == [["4"], ["0", "4"]]


def test_the_users_model_keeps_its_weights():
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    randomization_test(marking(model, (12, 13)), model, torch.randn(2, 2, 12, 13), [0, 1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("size", [(11, 30), (30, 11), (11, 11)])
def test_ssim_is_computed_from_11_pixels_a_side(size):
    """An 11x11 window fits: SSIM is a number, 1 where the map did not change (the ramp of the unmarked maps)."""
    model = make_model()

    def same(m: nn.Module, x: torch.Tensor, t) -> torch.Tensor:  # changes only at the first stage's column
        maps = torch.arange(size[0] * size[1], dtype=torch.float32).view(size).expand(len(x), *size).clone()
        if not torch.equal(m.get_submodule("4").weight, model.get_submodule("4").weight):
            maps[:, 0, 0] = 1000.0
        return maps

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = randomization_test(same, model, torch.randn(2, 2, 12, 13), [0, 1], layers=["4"])
    assert not result.ssim.isnan().any()
    assert (result.ssim < 0.999).all()  # the map changed at the only stage
    torch.testing.assert_close(result.spearman, torch.full((1, 2), result.spearman[0, 0].item()))


@pytest.mark.parametrize("size", [(10, 30), (30, 10)])
def test_ssim_is_nan_with_a_warning_below_11_pixels_a_side(size):
    model = make_model()

    def ramp(m: nn.Module, x: torch.Tensor, t) -> torch.Tensor:
        maps = torch.arange(size[0] * size[1], dtype=torch.float32).view(size).expand(len(x), *size).clone()
        return maps + (0 if torch.equal(m[4].weight, model[4].weight) else maps.flip(-1))

    with pytest.warns(UserWarning, match="smaller than SSIM's 11x11 window"):
        result = randomization_test(ramp, model, torch.randn(2, 2, 12, 13), [0, 1], layers=["4"])
    assert result.ssim.isnan().all()


def test_the_users_model_keeps_its_grads_with_a_backward_method():
    model = make_model()

    def saliency(m: nn.Module, x: torch.Tensor, t) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        m(x)[torch.arange(len(x)), t].sum().backward()
        return x.grad.abs().sum(dim=1)

    randomization_test(saliency, model, torch.randn(2, 2, 12, 13), [0, 1], layers=["4"])
    assert all(p.grad is None for p in model.parameters())
