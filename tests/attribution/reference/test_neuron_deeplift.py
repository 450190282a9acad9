"""NeuronDeepLift: hand-worked float64 values (Rescale multipliers), captum 0.9 parity, bad input, state kept."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution import NeuronDeepLift
from attribution.reference import AttributionsWithDelta
from hooks import ModuleNotFoundInModelError

F64 = torch.float64


def conv_relu() -> nn.Sequential:
    """A (1, 2) convolution with weights [1, -1], no bias, then a ReLU."""
    model = nn.Sequential(nn.Conv2d(1, 1, (1, 2), bias=False), nn.ReLU()).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[[[1.0, -1.0]]]]))
    return model


X = torch.tensor([[[[1.0, 3.0, 2.0], [4.0, -1.0, 0.0]]]], dtype=F64)  # conv: [[-2, 1], [5, -1]]
B = torch.tensor([[[0.0, 0.0, 0.0], [-3.0, 1.0, 0.0]]], dtype=F64)  # conv: [[0, 0], [-4, 1]]


def test_hand_worked_rescale_on_a_non_square_conv() -> None:
    model = conv_relu()
    # neuron (0, 1, 0): relu(5) - relu(-4) = 5 over a pre-activation change 9: multiplier 5/9 on d/dx = [+1, -1]
    got = NeuronDeepLift(model, "1", baseline=B)(X, (0, 1, 0), return_delta=True)
    assert isinstance(got, AttributionsWithDelta)
    attributions, delta = got
    expected = torch.tensor([[[[0.0, 0.0, 0.0], [7 * 5 / 9, (-2) * (-1) * 5 / 9, 0.0]]]], dtype=F64)
    torch.testing.assert_close(attributions, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(delta, torch.zeros(1, dtype=F64), rtol=0, atol=1e-12)  # 35/9 + 10/9 = 5
    multipliers = NeuronDeepLift(model, "1", baseline=B, multiply_by_inputs=False)(X, (0, 1, 0))
    torch.testing.assert_close(multipliers[0, 0, 1, :2], torch.tensor([5 / 9, -5 / 9], dtype=F64))
    # neuron (0, 0, 1): relu(1) - relu(0) = 1 over 1: attributions (x - b) * [+1, -1] = [3, -2]
    got = NeuronDeepLift(model, "1", baseline=B)(X, (0, 0, 1))
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 3.0, -2.0], [0.0, 0.0, 0.0]]]], dtype=F64))
    # a callable is the same linear combination of the two (the multipliers do not depend on the neuron)
    both = NeuronDeepLift(model, "1", baseline=B)(X, lambda y: y[:, 0, 1, 0] - 2 * y[:, 0, 0, 1])
    torch.testing.assert_close(both, expected - 2 * got, rtol=1e-12, atol=1e-12)


def test_neuron_at_the_convolution_is_its_gradient_times_the_difference() -> None:
    # conv (1, 1) = -1 - 0; linear, so (x - 1) * [+1, -1] at (1, 1), (1, 2): [-2, 1]
    got = NeuronDeepLift(conv_relu(), "0", baseline=1.0)(X, (0, 1, 1))
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 0.0, 0.0], [0.0, -2.0, 1.0]]]], dtype=F64), rtol=0, atol=0)


def cnn() -> nn.Sequential:
    """captum-like CNN: conv -> ReLU -> conv -> MaxPool -> conv -> Tanh -> linear (no two rule modules adjacent,
    where captum's DeepLift reads a gradient before the next rule rewrote it; see tests/attribution/reference/
    test_captum.py)."""
    torch.manual_seed(5)
    return (
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 4, 1),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 6, (2, 3)),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(6 * 2 * 2, 3),
        )
        .double()
        .eval()
    )


@pytest.mark.parametrize(
    ("layer", "neuron", "multiply"),
    [("1", (2, 3, 4), True), ("3", (1, 1, 2), True), ("5", (4, 1, 0), True), ("7", (2,), False), ("5", "f", True)],
)
def test_captum_parity(layer: str, neuron: object, multiply: bool) -> None:
    captum = pytest.importorskip("captum.attr")
    model = cnn()
    torch.manual_seed(6)
    x, b = torch.randn(3, 2, 6, 9, dtype=F64), torch.randn(3, 2, 6, 9, dtype=F64) * 0.3
    if neuron == "f":
        neuron = lambda y: y[:, 1].sum((1, 2)) - 2 * y[:, 3, 0, 1]  # noqa: E731
    ours, delta = NeuronDeepLift(model, layer, baseline=b, multiply_by_inputs=multiply)(x, neuron, return_delta=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = dict(model.named_modules())[layer]
        theirs = captum.NeuronDeepLift(model, module, multiply_by_inputs=multiply).attribute(x, neuron, baselines=b)
    assert (ours > 0).any() and (ours < 0).any()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-12)
    if multiply:
        assert delta.abs().max() < 1e-10  # the attributions sum to neuron(x) - neuron(baseline)


def state(model: nn.Module) -> tuple:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return model.training, [p.requires_grad for p in model.parameters()], hooks, grads


def same(a: tuple, b: tuple) -> bool:
    pairs = zip(a[3], b[3], strict=True)
    return a[:3] == b[:3] and all((g is None) == (h is None) and (g is None or torch.equal(g, h)) for g, h in pairs)


def test_bad_input_and_model_left_as_found() -> None:
    model = cnn().train()
    model[2].weight.requires_grad_(False)
    model[7].weight.grad = torch.full_like(model[7].weight, 2.0)
    x = torch.randn(2, 2, 6, 9, dtype=F64)
    model.eval()
    out = model(x).detach()
    model.train()
    before = state(model)
    NeuronDeepLift(model, "5")(x, (4, 1, 0))
    assert same(state(model), before)
    with pytest.raises(IndexError, match=r"shaped \(6, 2, 2\)"):
        NeuronDeepLift(model, "5")(x, (6, 0, 0))

    def broken(layer_output: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("a neuron callable that fails")

    with pytest.raises(ZeroDivisionError, match="fails"):
        NeuronDeepLift(model, "5")(x, broken)
    assert same(state(model), before)
    model.eval()
    assert torch.equal(model(x), out)
    with pytest.raises(ModuleNotFoundInModelError, match="not a module of the model"):
        NeuronDeepLift(model, "conv9")
    with pytest.raises(ValueError, match="must name one module"):
        NeuronDeepLift(model, "*")
