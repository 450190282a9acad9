"""Bad input gets a clear error; every call leaves the model as it found it, also when it raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import DeepLift, DeepLiftShap, GradientShap
from tests.support import hook_state


class Net(nn.Module):
    """Conv -> in-place ReLU -> BatchNorm -> dropout -> linear; ``fail`` raises inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 5 * 6, 3)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.relu(self.conv(x)))
        if self.fail:
            raise RuntimeError("stop")
        return self.fc(self.drop(h).flatten(1))


def methods(model: nn.Module) -> list:
    refs = torch.randn(3, 2, 5, 6, dtype=torch.float64)
    return [DeepLift(model, 0.1), DeepLiftShap(model, refs), GradientShap(model, refs, samples=2, stdevs=0.1)]


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
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]
    assert all(a is b for a, b in zip(after["grads"], before["grads"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after["buffers"], before["buffers"], strict=True))
    assert after["hooks"] == before["hooks"]
    assert after["grad_mode"] == before["grad_mode"]


@pytest.fixture
def model() -> Net:
    torch.manual_seed(0)
    net = Net().double().train()  # train mode on purpose: calls run in eval and restore it
    net.conv.weight.requires_grad_(False)
    net.fc.weight.grad = torch.ones_like(net.fc.weight)
    return net


@pytest.mark.parametrize("index", range(3), ids=["DeepLift", "DeepLiftShap", "GradientShap"])
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_the_model_is_left_as_found(model, index, fail):
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    before = snapshot(model)
    method = methods(model)[index]
    model.fail = fail
    with torch.no_grad():  # a caller's no_grad must not stop the call, and comes back
        if fail:
            with pytest.raises(RuntimeError, match="stop"):
                method(x, target=1)
        else:
            assert method(x, target=1).shape == x.shape
        assert_same(model, before | {"grad_mode": False})
    assert_same(model, before)


@pytest.mark.parametrize("index", range(3), ids=["DeepLift", "DeepLiftShap", "GradientShap"])
def test_a_baseline_of_the_wrong_shape_names_both_shapes(model, index):
    wrong = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
    method = [DeepLift(model, wrong), DeepLiftShap(model, wrong), GradientShap(model, wrong)][index]
    with pytest.raises(ValueError, match=r"\(2, 3, 5, 6\).*\(2, 2, 5, 6\)"):
        method(torch.randn(2, 2, 5, 6, dtype=torch.float64), target=0)


def test_a_callable_baseline_is_called_on_the_inputs(model):
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(DeepLift(model, lambda t: t.mean(0))(x, 0), DeepLift(model, x.mean(0))(x, 0))


def test_uint8_images_get_the_cams_conversion_error(model):
    images = torch.zeros(2, 3, 5, 6, dtype=torch.uint8)
    for method in methods(model):
        with pytest.raises(TypeError, match=r"images.float\(\) / 255"):
            method(images, target=0)


def test_nan_is_reported_by_item_and_kept(model):
    x = torch.randn(3, 2, 5, 6, dtype=torch.float64)
    x[1, 0, 2, 2] = float("nan")
    refs = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    for method in (DeepLift(model), DeepLiftShap(model, refs), GradientShap(model, refs, samples=2)):
        with pytest.warns(UserWarning, match="item 1 hold NaN"):
            out = method(x, target=0)
        assert out[1].isnan().any() and not out[[0, 2]].isnan().any()


def test_nan_baselines_are_refused(model):
    refs = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    refs[1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        DeepLiftShap(model, refs)(torch.randn(1, 2, 5, 6, dtype=torch.float64), target=0)


def test_bad_arguments_say_what_was_expected(model):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        DeepLift("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`samples`"):
        GradientShap(model, 0.0, samples=0)
    with pytest.raises(ValueError, match="`stdevs`"):
        GradientShap(model, 0.0, stdevs=-1.0)
    with pytest.raises(ValueError, match="one class per item"):
        DeepLift(model)(torch.randn(2, 2, 5, 6, dtype=torch.float64), target=[0, 1, 2])


def test_gradientshap_is_reproducible_and_seeded():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x, refs = torch.randn(2, 4), torch.randn(6, 4)
    first = GradientShap(model, refs, samples=4, stdevs=0.1, seed=1)(x, 0)
    torch.testing.assert_close(GradientShap(model, refs, samples=4, stdevs=0.1, seed=1)(x, 0), first, rtol=0, atol=0)
    assert not torch.equal(GradientShap(model, refs, samples=4, stdevs=0.1, seed=2)(x, 0), first)
