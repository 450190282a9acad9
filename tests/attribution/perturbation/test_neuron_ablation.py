"""NeuronFeatureAblation: hand-worked float64 values, captum 0.9 parity, the forward stops at the layer, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution import NeuronFeatureAblation
from hooks import ModuleNotFoundInModelError

F64 = torch.float64
X = torch.tensor([[[[1.0, 3.0, 2.0], [4.0, -1.0, 0.0]]]], dtype=F64)  # conv: [[-2, 1], [5, -1]]


class Counted(nn.Module):
    """Counts its calls (to see that the modules after the layer never run)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.flatten(1)


def conv_relu() -> nn.Sequential:
    """A (1, 2) convolution with weights [1, -1], no bias, a ReLU, then modules the neuron does not need."""
    model = nn.Sequential(nn.Conv2d(1, 1, (1, 2), bias=False), nn.ReLU(), Counted(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[[[1.0, -1.0]]]]))
    return model


def test_hand_worked_non_square_conv_both_signs() -> None:
    model = conv_relu()
    method = NeuronFeatureAblation(model, "1")
    # neuron (0, 1, 0) = relu(4 + 1) = 5; x(1, 0) -> 0: relu(1) = 1, drop 4; x(1, 1) -> 0: relu(4) = 4, drop 1
    torch.testing.assert_close(method(X, (0, 1, 0)), torch.tensor([[[[0.0, 0, 0], [4, 1, 0]]]], dtype=F64))
    # neuron (0, 0, 1) = relu(3 - 2) = 1; x(0, 1) -> 0: relu(-2) = 0, drop 1; x(0, 2) -> 0: relu(3) = 3, drop -2
    torch.testing.assert_close(method(X, (0, 0, 1)), torch.tensor([[[[0.0, 1, -2], [0, 0, 0]]]], dtype=F64))
    # a callable: the drop of the combination, per element (ablation is linear in the score)
    got = method(X, lambda y: y[:, 0, 1, 0] + 2 * y[:, 0, 0, 1])
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 2, -4], [4, 1, 0]]]], dtype=F64))
    assert model[2].calls == 0  # every forward stopped at the layer


def test_hand_worked_feature_mask_and_baseline() -> None:
    mask = torch.tensor([[[0, 0, 1], [1, 2, 2]]])
    # neuron (0, 1, 0) = 5; feature 1 {(0, 2), (1, 0)} -> 0: relu(0 + 1) = 1, drop 4; feature 2 {(1, 1), (1, 2)}:
    # relu(4 - 0) = 4, drop 1; feature 0 leaves the neuron's window alone
    got = NeuronFeatureAblation(conv_relu(), "1", feature_mask=mask)(X, (0, 1, 0))
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 0, 4], [4, 1, 1]]]], dtype=F64))
    # baseline 10: feature 1 -> relu(10 + 1) = 11, drop -6; feature 2 -> relu(4 - 10) = 0, drop 5
    got = NeuronFeatureAblation(conv_relu(), "1", feature_mask=mask, baseline=10.0)(X, (0, 1, 0))
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 0, -6], [-6, 5, 5]]]], dtype=F64))


def cnn() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, (2, 3)),
        nn.MaxPool2d(2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 3, 3),
    ).double()


@pytest.mark.parametrize(("layer", "neuron"), [("1", (2, 3, 4)), ("4", (1, 1, 2)), ("6", (2,)), ("4", "f")])
@pytest.mark.parametrize("masked", [False, True])
def test_captum_parity(layer: str, neuron: object, masked: bool) -> None:
    captum = pytest.importorskip("captum.attr")
    model = cnn()
    torch.manual_seed(8)
    x, b = torch.randn(3, 2, 6, 9, dtype=F64), torch.randn(1, 2, 6, 9, dtype=F64) * 0.3
    mask = (torch.arange(54).reshape(1, 1, 6, 9) // 4) % 7 if masked else None
    if neuron == "f":
        neuron = lambda y: y[:, 1].sum((1, 2)) - 2 * y[:, 3, 0, 1]  # noqa: E731
    ours = NeuronFeatureAblation(model, layer, feature_mask=mask, baseline=b, perturbations_per_forward=5)(x, neuron)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = dict(model.named_modules())[layer]
        theirs = captum.NeuronFeatureAblation(model, module).attribute(x, neuron, baselines=b, feature_mask=mask)
    assert (ours > 0).any() and (ours < 0).any()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-12)


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
    model[6].weight.grad = torch.full_like(model[6].weight, 2.0)
    x = torch.randn(2, 2, 6, 9, dtype=F64)
    before, out = state(model), model(x).detach()
    NeuronFeatureAblation(model, "4")(x, (1, 1, 2))
    assert same(state(model), before)
    with pytest.raises(IndexError, match=r"shaped \(4, 2, 3\)"):
        NeuronFeatureAblation(model, "4")(x, (1, 2, 0))

    def broken(layer_output: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("a neuron callable that fails")

    with pytest.raises(ZeroDivisionError, match="fails"):
        NeuronFeatureAblation(model, "4")(x, broken)
    assert same(state(model), before) and torch.equal(model(x), out)
    with pytest.raises(ModuleNotFoundInModelError, match="not a module of the model"):
        NeuronFeatureAblation(model, "conv9")
    with pytest.raises(ValueError, match="must name one module"):
        NeuronFeatureAblation(model, "*")


def test_token_ids_default_to_token_zero_without_a_config() -> None:
    model = nn.Sequential(nn.Embedding(5, 2), nn.Flatten(), nn.Linear(6, 1)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(10, dtype=F64).reshape(5, 2))  # token t -> [2t, 2t + 1]
    ids = torch.tensor([[1, 3, 2]])
    # unit (position 1, dim 0) = 2 * 3 = 6; only token 1 changes it: to token 0, value 0, drop 6
    got = NeuronFeatureAblation(model, "0")(ids, (1, 0))
    torch.testing.assert_close(got, torch.tensor([[0.0, 6.0, 0.0]], dtype=F64))
    got = NeuronFeatureAblation(model, "0", baseline=4)(ids, (1, 0))  # token 4: value 8, drop -2
    torch.testing.assert_close(got, torch.tensor([[0.0, -2.0, 0.0]], dtype=F64))
