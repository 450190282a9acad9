"""``cav``: the mean CAV is the difference of means, the logistic one its objective's minimum, errors name causes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.concepts import CAV, cav
from attribution.concepts._fit import split

from .models import randn, seeded, small_cnn

PLANTED = torch.tensor([0.3, -1.0, 0.0, 0.5, 2.0], dtype=torch.float64)


def identity_model() -> nn.Module:
    return seeded(nn.Sequential(nn.Identity(), nn.Linear(5, 3)), 0)


def test_the_mean_cav_is_the_normalised_difference_of_means_computed_slowly():
    concept, others = randn(9, 5, seed=1) + PLANTED, randn(7, 5, seed=2)
    found = cav(identity_model(), "0", concept, others, kind="mean", held_out=0.0)
    mean = [
        sum(concept[i, j].item() for i in range(9)) / 9 - sum(others[i, j].item() for i in range(7)) / 7
        for j in range(5)
    ]
    length = sum(v * v for v in mean) ** 0.5
    expected = torch.tensor([v / length for v in mean], dtype=torch.float64)
    torch.testing.assert_close(found.vector, expected, rtol=0, atol=1e-14)
    assert isinstance(found, CAV) and found.kind == "mean" and found.layer == "0" and found.shape == (5,)


def test_with_held_out_examples_the_mean_cav_is_the_difference_of_the_training_means():
    concept, others = randn(10, 5, seed=3) + PLANTED, randn(10, 5, seed=4)
    found = cav(identity_model(), "0", concept, others, kind="mean", seed=5)
    train, _ = split(torch.tensor([1] * 10 + [0] * 10), 0.2, seed=5)
    rows = torch.cat([concept, others])[train]
    pos = rows[: (train < 10).sum()]
    neg = rows[(train < 10).sum() :]
    expected = pos.mean(0) - neg.mean(0)
    torch.testing.assert_close(found.vector, expected / expected.norm(), rtol=0, atol=1e-14)


def test_the_logistic_cav_is_the_minimum_of_its_objective_and_points_to_the_concept():
    concept, others = randn(12, 5, seed=6) + 0.8 * PLANTED, randn(15, 5, seed=7)
    found = cav(identity_model(), "0", concept, others, held_out=0.0)
    assert torch.nn.functional.cosine_similarity(found.vector, PLANTED, dim=0) > 0.8
    # the same objective solved by Newton's method: centred rows over their rms norm, mean log-loss + 1e-3/2 |w|^2
    x = torch.cat([concept, others])
    s = torch.tensor([1.0] * 12 + [-1.0] * 15, dtype=torch.float64)
    z = (x - x.mean(0)) / (x - x.mean(0)).pow(2).sum(1).mean().sqrt()
    zb = torch.cat([z, torch.ones(27, 1, dtype=torch.float64)], 1)  # the bias as a last, unpenalised weight
    penalty = torch.diag(torch.tensor([1e-3] * 5 + [0.0], dtype=torch.float64))
    theta = torch.zeros(6, dtype=torch.float64)
    for _ in range(40):
        p = torch.sigmoid(-s * (zb @ theta))
        gradient = -(s * p) @ zb / 27 + penalty @ theta
        hessian = zb.T @ (zb * (p * (1 - p))[:, None]) / 27 + penalty
        theta = theta - torch.linalg.solve(hessian, gradient)
    assert gradient.abs().max() < 1e-12
    torch.testing.assert_close(found.vector, theta[:5] / theta[:5].norm(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("kind", ["logistic", "sgd", "mean"])
def test_swapping_the_sets_negates_the_cav(kind):
    concept, others = randn(10, 5, seed=8) + PLANTED, randn(10, 5, seed=9)
    ahead = cav(identity_model(), "0", concept, others, kind=kind, held_out=0.0)
    behind = cav(identity_model(), "0", others, concept, kind=kind, held_out=0.0)
    torch.testing.assert_close(behind.vector, -ahead.vector, rtol=0, atol=1e-7 if kind == "logistic" else 0.2)
    assert ahead.vector.norm().item() == pytest.approx(1.0, abs=1e-12)


def test_sgd_is_deterministic_by_seed_and_the_seed_matters():
    concept, others = randn(16, 5, seed=10) + 0.5 * PLANTED, randn(16, 5, seed=11)
    one = cav(identity_model(), "0", concept, others, kind="sgd", seed=3)
    assert torch.equal(one.vector, cav(identity_model(), "0", concept, others, kind="sgd", seed=3).vector)
    assert not torch.equal(one.vector, cav(identity_model(), "0", concept, others, kind="sgd", seed=4).vector)


def test_a_conv_layer_cav_lives_in_the_flattened_activations_and_is_accurate_on_held_out_examples():
    model = small_cnn()
    bright = randn(20, 3, 7, 6, seed=12) + 1.5
    found = cav(model, "1", bright, randn(20, 3, 7, 6, seed=13), held_out=0.25)
    assert found.vector.shape == (4 * 7 * 6,) and found.shape == (4, 7, 6)
    assert found.accuracy == 1.0  # 5 + 5 held-out examples, far apart


def test_the_model_is_left_as_found_also_when_the_call_raises():
    model = small_cnn().train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    x = randn(4, 3, 7, 6, seed=14)
    before = model(x).detach().clone()
    cav(model, "2", randn(5, 3, 7, 6, seed=15) + 1, randn(5, 3, 7, 6, seed=16))
    with pytest.raises(ValueError, match="shape"):
        cav(model, "2", randn(5, 3, 7, 6, seed=15), randn(5, 3, 9, 6, seed=16))
    assert model.training and all(m.training for m in model.modules())
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert torch.equal(model[2].weight.grad, torch.ones_like(model[2].weight)) and model[0].bias.grad is None
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    assert torch.equal(model(x), before)


def test_bad_input_is_refused_naming_the_cause():
    model, two = identity_model(), randn(2, 5, seed=17)
    with pytest.raises(ValueError, match=r"`concept` holds 1 example.*at least two"):
        cav(model, "0", randn(1, 5, seed=18), two)
    with pytest.raises(ValueError, match=r"`counterexamples` gives .*shape \(4,\).*`concept` gives \(5,\)"):
        cav(seeded(nn.Sequential(nn.Identity()), 0), "0", two, randn(3, 4, seed=19))
    with pytest.raises(KeyError, match="nope"):
        cav(model, "nope", two, two + 1)
    with pytest.raises(ValueError, match=r"matches 2 modules \('0', '1'\).*one layer"):
        cav(model, "*", two, two + 1)
    with pytest.raises(ValueError, match="cannot be told apart"):
        cav(model, "0", two, two.clone(), kind="mean")
    with pytest.raises(ValueError, match="`kind` must be one of"):
        cav(model, "0", two, two + 1, kind="svm")  # type: ignore[arg-type]
