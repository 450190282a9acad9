"""Known answers in float64: closed forms on a linear model, DeepLIFT worked out by hand, slow re-implementations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import DeepLift, DeepLiftShap, GradientShap
from attribution.reference import draw

F64 = torch.float64


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 3)).double().eval()


def weights_of(model: nn.Module, target: int) -> torch.Tensor:
    return model[1].weight[target].detach().view(2, 3)


# -- closed forms on a linear model --------------------------------------------------------------------------------
def test_deeplift_on_a_linear_model_is_coefficient_times_difference():
    model = linear_model()
    x = torch.randn(4, 2, 3, dtype=F64)
    b = torch.randn(2, 3, dtype=F64)
    result = DeepLift(model, b)(x, target=2, return_delta=True)
    torch.testing.assert_close(result.attributions, weights_of(model, 2) * (x - b), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.delta, torch.zeros(4, dtype=F64), rtol=0, atol=1e-13)


def test_deepliftshap_on_a_linear_model_uses_the_mean_baseline():
    model = linear_model()
    x, refs = torch.randn(3, 2, 3, dtype=F64), torch.randn(5, 2, 3, dtype=F64)
    result = DeepLiftShap(model, refs)(x, target=[0, 1, 2], return_delta=True)
    expected = torch.stack([weights_of(model, t) * (x[i] - refs.mean(0)) for i, t in enumerate([0, 1, 2])])
    torch.testing.assert_close(result.attributions, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-13)


def test_gradientshap_on_a_linear_model_uses_the_drawn_baselines():
    model = linear_model()
    x, refs = torch.randn(3, 2, 3, dtype=F64), torch.randn(4, 2, 3, dtype=F64)
    result = GradientShap(model, refs, samples=6, seed=7)(x, target=1, return_delta=True)
    drawn = refs[draw(3, 6, 4, (2, 3), 0.0, 7).index].view(3, 6, 2, 3).mean(1)
    torch.testing.assert_close(result.attributions, weights_of(model, 1) * (x - drawn), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-13)


# -- by hand --------------------------------------------------------------------------------------------------------
def one_relu_net() -> nn.Module:
    """``f(x) = v . relu(W x + c)`` with ``W = [[1, -1], [2, 1]]``, ``c = [0, -1]``, ``v = [1, -2]``."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1.0], [2.0, 1.0]]))
        model[0].bias.copy_(torch.tensor([0.0, -1.0]))
        model[2].weight.copy_(torch.tensor([[1.0, -2.0]]))
    return model


def test_rescale_on_a_one_relu_net_by_hand():
    # x = (2, 1), baseline 0: z = (1, 4), z_ref = (0, -1); multipliers (1 - 0) / 1 = 1 and (4 - 0) / 5 = 0.8;
    # d/dx = 1 * 1 * (1, -1) - 2 * 0.8 * (2, 1) = (-2.2, -2.6); times x = (-4.4, -2.6); sum -7 = f(x) - f(0) = -7 - 0
    result = DeepLift(one_relu_net())(torch.tensor([[2.0, 1.0]], dtype=F64), target=0, return_delta=True)
    torch.testing.assert_close(result.attributions, torch.tensor([[-4.4, -2.6]], dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(result.delta, torch.zeros(1, dtype=F64), rtol=0, atol=1e-13)
    multipliers = DeepLift(one_relu_net(), multiply_by_inputs=False)(torch.tensor([[2.0, 1.0]], dtype=F64), 0)
    torch.testing.assert_close(multipliers, torch.tensor([[-2.2, -2.6]], dtype=F64), rtol=1e-12, atol=0)


def test_rescale_falls_back_to_the_gradient_where_input_and_reference_meet():
    # the first hidden unit reads only x_1, equal in input and baseline: its multiplier is sigmoid'(z), not 0
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Sigmoid(), nn.Linear(2, 1, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.0, 1.5], [1.0, 0.0]]))
        model[2].weight.copy_(torch.tensor([[2.0, 1.0]]))
    x, b = torch.tensor([[3.0, 0.4]], dtype=F64), torch.tensor([[1.0, 0.4]], dtype=F64)
    m = DeepLift(model, b, multiply_by_inputs=False)(x, target=0)
    s = torch.sigmoid(torch.tensor(0.6, dtype=F64))
    rescaled = (torch.sigmoid(torch.tensor(3.0, dtype=F64)) - torch.sigmoid(torch.tensor(1.0, dtype=F64))) / 2
    torch.testing.assert_close(m, torch.stack([rescaled, 2.0 * 1.5 * s * (1 - s)])[None], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("x", "ref", "expected"),
    [  # input wins: max(3, 2) - 2 = 1 to the input's winner; the reference wins: 1 - 4 = -3 to the reference's
        ([3.0, 1.0], [0.0, 2.0], [1.0, 0.0]),
        ([1.0, 0.0], [0.0, 4.0], [0.0, -3.0]),
    ],
)
def test_max_pool_rule_by_hand(x, ref, expected):
    model = nn.Sequential(nn.MaxPool1d(2), nn.Flatten()).double()
    result = DeepLift(model, torch.tensor([ref], dtype=F64))(torch.tensor([[x]], dtype=F64), target=0)
    torch.testing.assert_close(result, torch.tensor([[expected]], dtype=F64), rtol=1e-12, atol=1e-15)


# -- slow re-implementations ----------------------------------------------------------------------------------------
def slow_deeplift_mlp(model: nn.Sequential, x: torch.Tensor, ref: torch.Tensor, target: int) -> torch.Tensor:
    """The Rescale rule straight from the paper: chain the multiplier matrices layer by layer, item by item."""
    out = []
    for xi, ri in zip(x, ref, strict=True):
        chain = torch.eye(xi.numel(), dtype=F64)
        a, r = xi, ri
        for layer in model:
            if isinstance(layer, nn.Linear):
                chain = layer.weight.detach() @ chain
                a, r = layer(a), layer(r)
            else:
                fa, fr = layer(a), layer(r)
                m = torch.where((a - r).abs() < 1e-10, 0.0, (fa - fr) / (a - r))
                chain = m[:, None] * chain
                a, r = fa, fr
        out.append(chain[target] * (xi - ri))
    return torch.stack(out).detach()


@pytest.mark.parametrize("act", [nn.ReLU, nn.ELU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.SiLU, nn.GELU])
def test_deeplift_matches_the_slow_rescale_rule(act):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), act(), nn.Linear(6, 5), act(), nn.Linear(5, 3)).double().eval()
    x, b = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    result = DeepLift(model, b)(x, target=1, return_delta=True)
    torch.testing.assert_close(result.attributions, slow_deeplift_mlp(model, x, b, 1), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)


def test_deepliftshap_is_the_mean_of_deeplift_over_the_baselines():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, refs = torch.randn(2, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    ours = DeepLiftShap(model, refs)(x, target=[2, 0], return_delta=True)
    each = [DeepLift(model, r)(x, target=[2, 0], return_delta=True) for r in refs]
    torch.testing.assert_close(ours.attributions, torch.stack([e.attributions for e in each]).mean(0))
    torch.testing.assert_close(ours.delta, torch.stack([e.delta for e in each]).mean(0), rtol=0, atol=1e-13)


def test_gradientshap_matches_a_slow_loop_over_its_draws():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, refs = torch.randn(2, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    d = draw(2, 3, 5, (4,), 0.2, 11)
    expected = torch.zeros(2, 4, dtype=F64)
    for row in range(6):
        item = row // 3
        xn, base = x[item] + d.noise[row], refs[d.index[row]]
        point = (d.alpha[row] * xn + (1 - d.alpha[row]) * base).requires_grad_(True)
        (grad,) = torch.autograd.grad(model(point[None])[0, 1], point)
        expected[item] += (xn - base) * grad / 3
    ours = GradientShap(model, refs, samples=3, stdevs=0.2, seed=11)(x, target=1)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-14)


def test_summation_to_delta_holds_through_relu_then_max_pool():
    # adjacent nonlinearities (VGG's ReLU -> MaxPool): the multipliers chain exactly, so the sum is exact
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 3), nn.ReLU()
    ).double()
    x, b = torch.randn(3, 2, 10, 10, dtype=F64), torch.randn(3, 2, 10, 10, dtype=F64) * 0.3
    result = DeepLift(model, b)(x, target=0, return_delta=True)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)
