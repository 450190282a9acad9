"""min_perturbation: hand-worked grids, captum 0.9's ``MinParamPerturbation`` live, the model's state, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.robust import fgsm, min_perturbation
from tests.support import hook_state


def identity() -> nn.Linear:
    model = nn.Linear(3, 3, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    return model


def shift(x: torch.Tensor, amount: float) -> torch.Tensor:
    """Moves score 2 up by ``amount``: class 0 (score 1.3) is overtaken once ``amount > 1.3 - 0.2``."""
    return x + torch.tensor([0.0, 0.0, 1.0], dtype=x.dtype) * amount


X = torch.tensor([[1.3, -0.5, 0.2]], dtype=torch.float64)


@pytest.mark.parametrize("mode", ["linear", "binary"])
def test_the_smallest_grid_value_that_flips(mode):
    options = {"attack": shift, "arg_name": "amount", "arg_min": 0.0, "arg_max": 4.0, "arg_step": 0.5, "mode": mode}
    perturbed, value = min_perturbation(identity(), X, 0, **options)
    assert value == 1.5  # 1.0 leaves 1.2 < 1.3; 1.5 gives 1.7 > 1.3
    torch.testing.assert_close(perturbed, shift(X, 1.5), rtol=0, atol=0)
    assert min_perturbation(identity(), X, 0, **{**options, "arg_max": 1.5}) == (None, None)  # arg_max is excluded
    assert min_perturbation(identity(), X, 1, **options)[1] == 0.0  # class 1 is never the prediction


def test_attempts_and_a_custom_correct_and_attack_kwargs():
    calls = []

    def noisy(x: torch.Tensor, amount: float, scale: float) -> torch.Tensor:
        calls.append(amount)
        return shift(x, amount * scale * (1 if len(calls) % 3 == 0 else 0))  # only every third attempt moves

    _, value = min_perturbation(
        identity(),
        X,
        2,
        attack=noisy,
        arg_name="amount",
        arg_min=0.0,
        arg_max=5.0,
        arg_step=1.0,
        attempts=3,
        attack_kwargs={"scale": 2.0},
        correct=lambda out, t: not bool(out[0, t] > 1.0),
    )
    assert value == 1.0 and calls == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # 0.2 + 2 > 1 on the third attempt of 1.0


@pytest.mark.parametrize("mode", ["linear", "binary"])
@pytest.mark.parametrize(("low", "high", "step"), [(0.0, 4.0, 0.5), (0.25, 3.0, 0.1), (0.0, 1.0, 0.3), (2.0, 9.0, 1.0)])
def test_equals_captums_min_param_perturbation(mode, low, high, step):
    metrics = pytest.importorskip("captum.robust")
    grid = {"arg_min": low, "arg_max": high, "arg_step": step, "mode": mode}
    for target in (0, 1, 2):
        ours = min_perturbation(identity(), X, target, attack=shift, arg_name="amount", **grid)
        captum = metrics.MinParamPerturbation(identity(), shift, "amount", low, high, step, mode=mode)
        theirs = captum.evaluate(X, target=target)
        assert ours[1] == theirs[1]
        if ours[0] is not None:
            assert torch.equal(ours[0], theirs[0])


def test_equals_captums_with_fgsm_as_the_attack():
    metrics = pytest.importorskip("captum.robust")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1)).double().eval()
    x = torch.randn(1, 4, dtype=torch.float64)
    label = int(model(x).argmax())

    def attack(inputs: torch.Tensor, epsilon: float) -> torch.Tensor:
        return fgsm(model, inputs, label, epsilon=epsilon)

    for mode in ("linear", "binary"):
        ours = min_perturbation(
            model, x, label, attack=attack, arg_name="epsilon", arg_min=0.0, arg_max=5.0, arg_step=0.05, mode=mode
        )
        theirs = metrics.MinParamPerturbation(model, attack, "epsilon", 0.0, 5.0, 0.05, mode=mode).evaluate(
            x, target=label
        )
        assert ours[1] == theirs[1] and ours[1] is not None and torch.equal(ours[0], theirs[0])


def test_the_model_is_left_as_it_was_also_when_it_raises():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).double().train()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    grad, hooks = model[0].weight.grad, hook_state(model)
    options = {"attack": shift, "arg_name": "amount", "arg_min": 0.0, "arg_max": 2.0, "arg_step": 0.5}
    min_perturbation(model, X, 0, **options)
    with pytest.raises(ValueError, match="default `correct` needs a \\(batch, classes\\)"):
        min_perturbation(nn.Sequential(model, nn.Flatten(0)), X, 0, **options)  # a (3,) output
    with pytest.raises(RuntimeError, match="boom"):
        min_perturbation(
            model, X, 0, **{**options, "attack": lambda x, amount: (_ for _ in ()).throw(RuntimeError("boom"))}
        )
    assert model.training and model[1].training and hook_state(model) == hooks and model[0].weight.grad is grad


def test_errors_say_what_was_expected():
    options = {"attack": shift, "arg_name": "amount", "arg_min": 0.0, "arg_max": 2.0, "arg_step": 0.5}
    with pytest.raises(ValueError, match="`mode` must be 'linear' or 'binary'; got 'bisect'"):
        min_perturbation(identity(), X, 0, **{**options, "mode": "bisect"})
    with pytest.raises(ValueError, match="`arg_step` must be > 0"):
        min_perturbation(identity(), X, 0, **{**options, "arg_step": 0})
    with pytest.raises(ValueError, match="`arg_max` must be a finite number"):
        min_perturbation(identity(), X, 0, **{**options, "arg_max": float("inf")})
    with pytest.raises(ValueError, match="`attempts` must be an int >= 1"):
        min_perturbation(identity(), X, 0, **options, attempts=0)
