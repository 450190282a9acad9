"""Conductance family: captum's known values, completeness, formulas re-implemented slowly, errors, model state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import (
    IntegratedGradients,
    InternalInfluence,
    LayerConductance,
    NeuronConductance,
    NeuronIntegratedGradients,
)
from attribution.gradients._quadrature import nodes_and_weights


class MultiLayer(nn.Module):
    """captum's ``BasicModel_MultiLayer``, built by hand: identity, ones with bias [-10, 1, 1, 1], ReLU, ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear0, self.linear1 = nn.Linear(3, 3), nn.Linear(3, 4)
        self.relu, self.linear2 = nn.ReLU(), nn.Linear(4, 2)
        with torch.no_grad():
            self.linear0.weight.copy_(torch.eye(3))
            self.linear0.bias.zero_()
            self.linear1.weight.fill_(1.0)
            self.linear1.bias.copy_(torch.tensor([-10.0, 1.0, 1.0, 1.0]))
            self.linear2.weight.fill_(1.0)
            self.linear2.bias.copy_(torch.tensor([-1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(self.linear0(x))))


def _smooth() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 6), nn.Softplus(), nn.Linear(6, 3)).double()


@pytest.mark.parametrize(
    ("layer", "expected"),
    [("linear0", [0.0, 390.0, 0.0]), ("linear1", [90.0, 100.0, 100.0, 100.0]), ("linear2", [390.0, 0.0])],
)
def test_captum_known_values_multilayer(layer: str, expected: list[float]) -> None:
    model = MultiLayer().double()
    x = torch.tensor([[0.0, 100.0, 0.0]], dtype=torch.float64)
    got, delta = LayerConductance(model, layer, steps=500)(x, target=0, return_delta=True)
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=0.1)
    assert delta.abs().item() < 0.1


def test_completeness_both_signs_several_targets() -> None:
    model = _smooth()
    x = torch.randn(4, 5, dtype=torch.float64) * torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0], dtype=torch.float64)
    base = -0.3 * torch.ones(1, 5, dtype=torch.float64)
    target = [0, 2, 1, 2]
    got, delta = LayerConductance(model, "3", steps=200, baseline=base)(x, target=target, return_delta=True)
    rows = torch.arange(4)
    gain = model(x)[rows, target] - model(base.expand(4, 5))[rows, target]
    assert (got > 0).any() and (got < 0).any()
    torch.testing.assert_close(got.sum(1), gain.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(delta, got.sum(1) - gain.detach(), rtol=0, atol=1e-12)


def test_conductance_equals_the_sum_written_out() -> None:
    model = _smooth()
    x = torch.randn(2, 5, dtype=torch.float64)
    steps = 6
    got = LayerConductance(model, "1", steps=steps, method="riemann_trapezoid")(x, target=[1, 0])
    alphas = torch.linspace(0, 1, steps + 1, dtype=torch.float64)
    slow = torch.zeros(2, 4, dtype=torch.float64)
    for i in range(2):
        ys, gs = [], []
        for a in alphas:
            y = model[:2](a * x[i : i + 1]).detach().requires_grad_()
            (g,) = torch.autograd.grad(model[2:](y)[0, [1, 0][i]], y)
            ys.append(y.detach()[0])
            gs.append(g[0])
        slow[i] = sum(gs[k] * (ys[k + 1] - ys[k]) for k in range(steps))
    torch.testing.assert_close(got, slow, rtol=1e-12, atol=1e-14)
    chunked = LayerConductance(model, "1", steps=steps, method="riemann_trapezoid", internal_batch_size=5)
    torch.testing.assert_close(chunked(x, target=[1, 0]), got, rtol=1e-12, atol=1e-14)


def test_internal_influence_written_out() -> None:
    model = _smooth()
    x = torch.randn(3, 5, dtype=torch.float64)
    base = torch.randn(5, dtype=torch.float64)
    got = InternalInfluence(model, "2", steps=7, baseline=base, internal_batch_size=4)(x, target=2)
    alphas, weights = nodes_and_weights("gausslegendre", 7)
    slow = torch.zeros(3, 6, dtype=torch.float64)
    for a, w in zip(alphas, weights, strict=True):
        y = model[:3](base + a * (x - base)).detach().requires_grad_()
        (g,) = torch.autograd.grad(model[3:](y)[:, 2].sum(), y)
        slow += w * g
    torch.testing.assert_close(got, slow, rtol=1e-12, atol=1e-14)


def test_neuron_conductances_sum_to_its_layer_conductance() -> None:
    model = _smooth()
    x = torch.randn(3, 5, dtype=torch.float64)
    layer = LayerConductance(model, "3", steps=300)(x, target=1)
    for j in range(6):
        inputs = NeuronConductance(model, "3", steps=300)(x, (j,), target=1)
        torch.testing.assert_close(inputs.sum(1), layer[:, j], rtol=1e-3, atol=1e-5)
    by_callable = NeuronConductance(model, "3", steps=20)(x, lambda y: y[:, 4], target=1)
    torch.testing.assert_close(by_callable, NeuronConductance(model, "3", steps=20)(x, (4,), target=1))


def test_neuron_integrated_gradients_completeness_and_ig() -> None:
    model = _smooth()
    x = torch.randn(3, 5, dtype=torch.float64) * 2
    base = torch.full((1, 5), 0.5, dtype=torch.float64)
    got = NeuronIntegratedGradients(model, "1", steps=64, baseline=base, internal_batch_size=7)(x, (2,))
    gain = model[:2](x)[:, 2] - model[:2](base)[:, 2]
    torch.testing.assert_close(got.sum(1), gain.detach(), rtol=1e-8, atol=1e-10)
    ig = IntegratedGradients(model[:2], steps=64, baseline=base)(x, target=2)  # the neuron as a model's output
    torch.testing.assert_close(got, ig, rtol=1e-12, atol=1e-14)
    raw = NeuronIntegratedGradients(model, "1", steps=64, baseline=base, multiply_by_inputs=False)(x, (2,))
    torch.testing.assert_close(raw * (x - base), got, rtol=1e-12, atol=1e-14)


def test_bad_layer_neuron_and_options() -> None:
    model = _smooth()
    x = torch.randn(2, 5, dtype=torch.float64)
    with pytest.raises((KeyError, ValueError), match="nonexistent"):
        LayerConductance(model, "nonexistent")
    with pytest.raises((KeyError, ValueError), match="layer"):
        NeuronConductance(model, "9")
    with pytest.raises(IndexError, match="shaped"):
        NeuronConductance(model, "1", steps=3)(x, (4,), target=0)
    with pytest.raises(IndexError, match="shaped"):
        NeuronIntegratedGradients(model, "1", steps=3)(x, (0, 1))
    with pytest.raises(ValueError, match="steps"):
        LayerConductance(model, "1", steps=0)
    with pytest.raises(ValueError, match="method"):
        InternalInfluence(model, "1", method="simpson")  # type: ignore[arg-type]


class Net(nn.Module):
    """Conv -> BatchNorm -> dropout -> linear, run in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(3 * 4 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.act(self.norm(self.conv(x)))).flatten(1))


def _state(model: nn.Module) -> list:
    return [
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
        [p.grad for p in model.parameters()],
        [p.detach().clone() for p in model.parameters()],
        [b.clone() for b in model.buffers()],
        [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
    ]


def _same(a: list, b: list) -> bool:
    return all(
        all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def test_model_left_as_found_also_on_error() -> None:
    torch.manual_seed(0)
    model = Net().double().eval()
    x = torch.randn(2, 2, 4, 5, dtype=torch.float64)
    out = model(x)
    model.train()
    model.conv.bias.requires_grad_(False)
    before = _state(model)
    calls = [
        lambda: LayerConductance(model, "act", steps=3)(x, target=1, return_delta=True),
        lambda: InternalInfluence(model, "norm", steps=3, internal_batch_size=2)(x),
        lambda: NeuronConductance(model, "act", steps=3)(x, (1, 2, 3), target=[0, 2]),
        lambda: NeuronIntegratedGradients(model, "conv", steps=3)(x, (2, 0, 4)),
    ]
    for call in calls:
        call()
        assert _same(_state(model), before)
    with pytest.raises(IndexError):
        NeuronConductance(model, "act", steps=3)(x, (3, 0, 0), target=0)
    assert _same(_state(model), before)
    assert torch.equal(model.eval()(x), out)
