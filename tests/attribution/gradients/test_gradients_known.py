"""Known answers in float64: closed forms, slow re-implementations of each paper's formula, hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attribution import (
    Deconvolution,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)
from attribution.gradients._quadrature import nodes_and_weights
from tests.attribution.models import SCALAR_TARGETS, ScalarPolynomials, ScalarReLUs, scalars

RULES = ["gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid"]


class ExpOfLinear(nn.Module):
    """``f(x) = exp(w . x)`` over the flattened item, as ``(batch, 1)`` logits: IG has a closed form."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.flatten(1) @ self.w.flatten())[:, None]


def exp_model() -> tuple[ExpOfLinear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(2, 3, dtype=torch.float64) * 0.5
    x, b = torch.randn(2, 2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64) * 0.3
    return ExpOfLinear(w), x, b


def closed_form_ig(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(x - b) w (e^{w.x} - e^{w.b}) / (w.(x - b))``: the exact path integral for ``exp(w . x)``."""
    wx, wb = (x.flatten(1) @ w.flatten()), (b.flatten() @ w.flatten())
    factor = (torch.exp(wx) - torch.exp(wb)) / (wx - wb)
    return (x - b) * w * factor.view(-1, 1, 1)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double().eval()


# -- Integrated Gradients ----------------------------------------------------------------------------------------
def test_quadrature_nodes_and_weights_match_numpy_and_hand_values():
    for n in (1, 2, 7, 50):
        t, w = np.polynomial.legendre.leggauss(n)
        a, weights = nodes_and_weights("gausslegendre", n)
        np.testing.assert_allclose(a.numpy(), (t + 1) / 2, rtol=0, atol=1e-15)
        np.testing.assert_allclose(weights.numpy(), w / 2, rtol=0, atol=1e-15)
    hand = {
        "riemann_left": [0.0, 0.25, 0.5, 0.75],
        "riemann_right": [0.25, 0.5, 0.75, 1.0],
        "riemann_middle": [0.125, 0.375, 0.625, 0.875],
        "riemann_trapezoid": [0.0, 1 / 3, 2 / 3, 1.0],
    }
    for rule, nodes in hand.items():
        a, weights = nodes_and_weights(rule, 4)
        torch.testing.assert_close(a, torch.tensor(nodes, dtype=torch.float64), rtol=0, atol=1e-15)
        expected = [0.125, 0.25, 0.25, 0.125] if rule == "riemann_trapezoid" else [0.25] * 4  # captum's weights
        assert weights.tolist() == expected


def test_integrated_gradients_equals_the_closed_form_integral():
    model, x, b = exp_model()
    got, delta = IntegratedGradients(model, steps=24, baseline=b)(x, target=0, return_delta=True)
    torch.testing.assert_close(got, closed_form_ig(model.w.detach(), x, b), rtol=1e-12, atol=1e-14)
    assert delta.abs().max() < 1e-12


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_its_weighted_sum_of_gradients(rule):
    """IG = (x - b) * sum_k w_k grad f(b + a_k (x - b)), with grad f = w exp(w . z) written out by hand."""
    model, x, b = exp_model()
    w = model.w.detach()
    a, weights = nodes_and_weights(rule, 5)
    slow = torch.zeros_like(x)
    for a_k, w_k in zip(a.tolist(), weights.tolist(), strict=True):
        z = b + a_k * (x - b)
        slow += w_k * w * torch.exp(z.flatten(1) @ w.flatten()).view(-1, 1, 1)
    got = IntegratedGradients(model, steps=5, method=rule, baseline=b, internal_batch_size=4)(x, target=0)
    torch.testing.assert_close(got, slow * (x - b), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("rule", RULES)
def test_completeness_error_shrinks_as_steps_grow(rule):
    model = mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    deltas = [
        IntegratedGradients(model, steps=n, method=rule)(x, target=2, return_delta=True)[1].abs().max().item()
        for n in (4, 32, 256)
    ]
    assert deltas[0] > deltas[1] > deltas[2] or deltas[2] < 1e-13
    assert deltas[2] < (1e-13 if rule == "gausslegendre" else 5e-3)


def test_internal_batches_and_baseline_forms_agree():
    model, x = mlp(), torch.randn(3, 5, dtype=torch.float64)
    one = torch.linspace(-1, 1, 5, dtype=torch.float64)
    full = IntegratedGradients(model, steps=9, baseline=one)(x, target=1)
    for batch in (1, 3, 10, 100):
        chunked = IntegratedGradients(model, steps=9, baseline=one[None], internal_batch_size=batch)(x, target=1)
        torch.testing.assert_close(chunked, full, rtol=1e-13, atol=1e-15)
    called = IntegratedGradients(model, steps=9, baseline=lambda z: one.expand_as(z))(x, target=1)
    torch.testing.assert_close(called, full, rtol=0, atol=0)


def test_target_forms_agree():
    model, x = mlp(), torch.randn(3, 5, dtype=torch.float64)
    for method in (IntegratedGradients(model, steps=4), SmoothGrad(Saliency(model), samples=3, seed=1)):
        expected = method(x, torch.tensor([2, 0, 1]))
        for form in ([2, 0, 1], np.array([2, 0, 1]), (2, 0, 1)):
            torch.testing.assert_close(method(x, form), expected, rtol=0, atol=0)
        torch.testing.assert_close(method(x, 1), method(x, [1, 1, 1]), rtol=0, atol=0)
        torch.testing.assert_close(method(x, np.int64(1)), method(x, torch.tensor(1)), rtol=0, atol=0)


def test_target_none_is_each_items_top_class():
    model, x = mlp(), torch.randn(4, 5, dtype=torch.float64)
    top = model(x).argmax(1)
    for method in (IntegratedGradients(model, steps=6), Saliency(model), InputXGradient(model)):
        torch.testing.assert_close(method(x), method(x, target=top), rtol=0, atol=0)


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(ids)).mean(1)


def test_embedding_level_ig_is_input_ig_of_the_rest_of_the_model():
    torch.manual_seed(1)
    model = TokenModel().double().eval()
    ids, pad = torch.tensor([[1, 5, 7, 2, 2], [3, 3, 9, 10, 0]]), torch.full((2, 5), 4)
    got, delta = IntegratedGradients(model, steps=16, baseline=pad, layer="embed")(ids, target=3, return_delta=True)
    rest = nn.Sequential()  # the model after the embedding, taking embeddings as its input
    rest.forward = lambda e: model.mix(e).mean(1)  # type: ignore[method-assign]
    expected = IntegratedGradients(rest, steps=16, baseline=model.embed(pad).detach())(
        model.embed(ids).detach(), target=3
    )
    assert got.shape == (2, 5, 6)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)
    assert delta.abs().max() < 1e-10


# -- Saliency, Input x Gradient -----------------------------------------------------------------------------------
def test_saliency_and_input_x_gradient_of_a_linear_map():
    model = nn.Linear(6, 3, bias=True).double()
    x = torch.randn(2, 6, dtype=torch.float64)
    target = torch.tensor([2, 0])
    w = model.weight.detach()[target]
    torch.testing.assert_close(Saliency(model, abs=False)(x, target), w, rtol=0, atol=0)
    torch.testing.assert_close(Saliency(model)(x, target), w.abs(), rtol=0, atol=0)
    torch.testing.assert_close(InputXGradient(model)(x, target), x * w, rtol=0, atol=0)


def test_layer_saliency_is_the_gradient_at_the_layer_output():
    model, x = mlp(), torch.randn(3, 5, dtype=torch.float64)
    hidden = model[1](model[0](x)).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model[2](hidden)[:, 1].sum(), hidden)
    torch.testing.assert_close(Saliency(model, abs=False, layer="1")(x, 1), grad, rtol=0, atol=0)
    torch.testing.assert_close(InputXGradient(model, layer="1")(x, 1), hidden.detach() * grad, rtol=0, atol=0)


# -- Guided Backprop, Deconvolution, Guided Grad-CAM --------------------------------------------------------------
def relu_net() -> nn.Sequential:
    torch.manual_seed(4)
    return (
        nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
        .double()
        .eval()
    )


def slow_modified_backward(model: nn.Sequential, x: torch.Tensor, target: int, rule: str) -> torch.Tensor:
    """The papers' rules written out layer by layer: GB ``max(g, 0) [z > 0]``, deconvnet ``max(g, 0)``."""
    w1, w2, w3 = (model[i].weight.detach() for i in (0, 2, 4))
    z1 = x @ w1.T + model[0].bias.detach()
    z2 = torch.relu(z1) @ w2.T + model[2].bias.detach()
    g = w3[target].expand(x.shape[0], -1)
    g = g.clamp(min=0) * (z2 > 0) if rule == "guided" else g.clamp(min=0)
    g = g @ w2
    g = g.clamp(min=0) * (z1 > 0) if rule == "guided" else g.clamp(min=0)
    return g @ w1


@pytest.mark.parametrize(("method", "rule"), [(GuidedBackprop, "guided"), (Deconvolution, "deconvolution")])
def test_modified_relu_backward_matches_the_rule(method, rule):
    model = relu_net()
    x = torch.randn(4, 5, dtype=torch.float64)
    for target in (0, 2):
        expected = slow_modified_backward(model, x, target, rule)
        torch.testing.assert_close(method(model)(x, target), expected, rtol=1e-13, atol=1e-15)


def test_guided_gradcam_is_guided_backprop_times_the_raw_upsampled_map():
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3),
    ).double().eval()  # fmt: skip
    x = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    acts = model[:4](x).detach().requires_grad_()
    (grads,) = torch.autograd.grad(model[4:](acts)[:, 1].sum(), acts)
    cam = torch.relu((grads.mean((2, 3), keepdim=True) * acts.detach()).sum(1, keepdim=True))  # (2, 1, 4, 3)
    expected = GuidedBackprop(model)(x, 1) * F.interpolate(cam, size=(8, 6), mode="nearest")
    got = GuidedGradCAM(model, "3")(x, 1)
    assert got.shape == x.shape and got.abs().amax() > 0
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)


# -- SmoothGrad ---------------------------------------------------------------------------------------------------
def test_smoothgrad_equals_a_slow_loop_with_the_same_noise():
    model, x = mlp(), torch.randn(2, 5, dtype=torch.float64) * torch.tensor([[1.0], [3.0]], dtype=torch.float64)
    samples, noise, target = 7, 0.15, torch.tensor([0, 2])
    generator = torch.Generator().manual_seed(11)
    spread = noise * (x.amax(1) - x.amin(1))  # per item: the relative noise level
    draws = torch.normal(
        0.0, spread.repeat_interleave(samples)[:, None].expand(-1, 5).contiguous(), generator=generator
    )
    expected = torch.zeros_like(x)
    for b in range(2):
        for s in range(samples):
            z = (x[b] + draws[b * samples + s]).requires_grad_()
            (grad,) = torch.autograd.grad(model(z[None])[0, target[b]], z)
            expected[b] += grad.abs() / samples
    state = torch.get_rng_state()
    got = SmoothGrad(Saliency(model), samples=samples, noise=noise, seed=11, batch_size=3)(x, target)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not used
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)


def test_smoothgrad_seed_none_draws_fresh_noise_and_zero_noise_is_the_method():
    model, x = mlp(), torch.randn(2, 5, dtype=torch.float64)
    a, b = (SmoothGrad(Saliency(model), samples=3)(x, 0) for _ in range(2))
    assert not torch.equal(a, b)
    torch.testing.assert_close(
        SmoothGrad(InputXGradient(model), samples=2, noise=0.0)(x, 0), InputXGradient(model)(x, 0)
    )


def test_smoothgrad_around_integrated_gradients():
    model, x = mlp(), torch.randn(2, 5, dtype=torch.float64)
    ig = IntegratedGradients(model, steps=8)
    got = SmoothGrad(ig, samples=4, noise=0.1, seed=0)(x, 1)
    noise = torch.normal(
        0.0,
        (0.1 * (x.amax(1) - x.amin(1))).repeat_interleave(4)[:, None].expand(-1, 5).contiguous(),
        generator=torch.Generator().manual_seed(0),
    ).view(2, 4, 5)
    expected = torch.stack([ig(x + noise[:, s], 1) for s in range(4)]).mean(0)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


# -- 1-D inputs: a batch of scalars ---------------------------------------------------------------------------------
# ScalarPolynomials at x = (1.5, -2, -0.5), targets (x^2, -x^3, -x^3): gradients 2x = 3 and -3x^2 = -12, -0.75;
# Integrated Gradients from 0 is the score itself: 2.25, 8, 0.125 (Gauss-Legendre with 3 nodes is exact here).
SCALAR_CASES = {
    "Saliency": (lambda m, **kw: Saliency(m, **kw), [3.0, 12.0, 0.75]),
    "Saliency-signed": (lambda m, **kw: Saliency(m, abs=False, **kw), [3.0, -12.0, -0.75]),
    "InputXGradient": (lambda m, **kw: InputXGradient(m, **kw), [4.5, 24.0, 0.375]),
    "IntegratedGradients": (lambda m, **kw: IntegratedGradients(m, steps=3, **kw), [2.25, 8.0, 0.125]),
}


@pytest.mark.parametrize("name", sorted(SCALAR_CASES))
@pytest.mark.parametrize("layer", [None, "scale"], ids=["input", "layer"])
def test_a_batch_of_scalars_gets_the_hand_worked_gradients(name, layer):
    make, expected = SCALAR_CASES[name]
    got = make(ScalarPolynomials(), layer=layer)(scalars(), SCALAR_TARGETS)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0.0)


def test_integrated_gradients_of_scalars_reports_one_delta_per_item():
    _, delta = IntegratedGradients(ScalarPolynomials(), steps=3)(scalars(), SCALAR_TARGETS, return_delta=True)
    assert delta.shape == (3,) and float(delta.abs().max()) < 1e-14


def test_smoothgrad_of_scalars_adds_no_noise_and_says_so():
    """An item of 1-D inputs is one number: its range, and so the relative noise, is 0."""
    with pytest.warns(UserWarning, match=r"items \[0, 1, 2\] are constant"):
        got = SmoothGrad(Saliency(ScalarPolynomials()), samples=4, noise=0.2, seed=0)(scalars(), SCALAR_TARGETS)
    torch.testing.assert_close(got, torch.tensor([3.0, 12.0, 0.75], dtype=torch.float64), rtol=1e-14, atol=0.0)


@pytest.mark.parametrize(
    ("method", "expected"),
    # ScalarReLUs at x = (1.5, -2, -0.5), targets (0, 0, 1): gradient (2, 0, 3); Guided Backprop passes the
    # positive upstream gradient 2 where the unit is active, Deconvolution wherever it is (item 1); -3 never passes
    [(GuidedBackprop, [2.0, 0.0, 0.0]), (Deconvolution, [2.0, 2.0, 0.0])],
)
def test_modified_relus_on_a_batch_of_scalars(method, expected):
    with pytest.warns(UserWarning, match="item 2 are all zero|items .* are all zero"):
        got = method(ScalarReLUs())(scalars(), [0, 0, 1])
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0.0, atol=0.0)
