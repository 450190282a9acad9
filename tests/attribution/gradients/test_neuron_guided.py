"""NeuronGuidedBackprop: hand-worked float64 values, captum 0.9 parity, bad input, the model left as found."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution import NeuronGradient, NeuronGuidedBackprop
from hooks import ModuleNotFoundInModelError

F64 = torch.float64


def two_relus() -> nn.Sequential:
    """x -> W1 x -> ReLU -> W2 . -> ReLU, W1 = [[1, 2], [-1, 1]], W2 = [[3, -2], [1, 1]], no biases."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 2, bias=False), nn.ReLU()).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0], [-1.0, 1.0]]))
        model[2].weight.copy_(torch.tensor([[3.0, -2.0], [1.0, 1.0]]))
    return model


def test_hand_worked_two_relus_tuple_and_callable() -> None:
    model = two_relus()
    x = torch.tensor([[1.0, 2.0], [-1.0, 3.0]], dtype=F64)
    # item 0: h = [5, 1] (both on), z0 = 15 - 2 = 13 (on); item 1: h = [5, 4], z0 = 15 - 8 = 7 (on).
    # guided: dz0 = 1 kept; d relu(h) = W2[0] = [3, -2] -> clamp [3, 0] -> mask [1, 1]; [3, 0] @ W1 = [3, 6]
    expected = torch.tensor([[3.0, 6.0], [3.0, 6.0]], dtype=F64)
    got = NeuronGuidedBackprop(model, "3")(x, (0,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the plain gradient lets -2 pass: [3, -2] @ W1 = [5, 4]
    plain = NeuronGradient(model, "3")(x, (0,))
    torch.testing.assert_close(plain, torch.tensor([[5.0, 4.0], [5.0, 4.0]], dtype=F64), rtol=0, atol=0)
    # a callable with a negative part: d/dz = [1, -1] -> clamped to [1, 0] at the last ReLU: neuron 0 again
    torch.testing.assert_close(NeuronGuidedBackprop(model, "3")(x, lambda y: y[:, 0] - y[:, 1]), expected)
    # the negated neuron: its gradient -1 is cut at the neuron's own ReLU (the layer's rule applies, as captum)
    with pytest.warns(UserWarning, match="all zero"):
        negated = NeuronGuidedBackprop(model, "3")(x, lambda y: -y[:, 0])
    torch.testing.assert_close(negated, torch.zeros_like(x), rtol=0, atol=0)


def test_hand_worked_non_square_conv_both_signs() -> None:
    model = nn.Sequential(nn.Conv2d(1, 1, (1, 2), bias=False), nn.ReLU()).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[[[1.0, -1.0]]]]))
    x = torch.tensor([[[[1.0, 3.0, 2.0], [4.0, -1.0, 0.0]]]], dtype=F64)  # conv: [[-2, 1], [5, -1]]
    method = NeuronGuidedBackprop(model, "1")
    got = method(x, (0, 0, 1))  # 3 - 2 = 1, on: +1 at (0, 1), -1 at (0, 2)
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 1.0, -1.0], [0.0, 0.0, 0.0]]]], dtype=F64))
    got = method(x, lambda y: y[:, 0, 1, 0] + 2 * y[:, 0, 0, 1])  # 5 (on) + 2 * 1 (on)
    torch.testing.assert_close(got, torch.tensor([[[[0.0, 2.0, -2.0], [1.0, -1.0, 0.0]]]], dtype=F64))
    with pytest.warns(UserWarning, match="all zero"):
        cut = method(x, (0, 1, 1))  # -1: off
    assert torch.equal(cut, torch.zeros_like(x))


def captum_net() -> nn.Sequential:
    """captum's BasicModel_ConvNet_One_Conv-like CNN in float64: conv, ReLUs, max pool, linear layers."""
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(),
        nn.Conv2d(3, 4, (2, 3), padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 2 * 3, 5),
        nn.ReLU(),
        nn.Linear(5, 3),
    ).double()


@pytest.mark.parametrize(
    ("layer", "neuron"),
    [("0", (1, 2, 3)), ("1", (0, 1, 2)), ("3", (0, 2, 4)), ("7", (3,)), ("8", (1,)), ("3", "callable")],
)
def test_captum_parity(layer: str, neuron: object) -> None:
    captum = pytest.importorskip("captum.attr")
    model = captum_net()
    torch.manual_seed(4)
    x = torch.randn(3, 2, 6, 9, dtype=F64)
    if neuron == "callable":
        neuron = lambda y: y[:, 1].sum((1, 2)) - 0.5 * y[:, 3, 2, 2]  # noqa: E731
    ours = NeuronGuidedBackprop(model, layer)(x, neuron)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum.NeuronGuidedBackprop(model, dict(model.named_modules())[layer]).attribute(x, neuron)
    assert ours.abs().sum() > 0 and (ours > 0).any() and (ours < 0).any()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-12)


def state(model: nn.Module) -> tuple:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return model.training, [p.requires_grad for p in model.parameters()], hooks, grads


def same(a: tuple, b: tuple) -> bool:
    grads_equal = all(
        (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
        for g, h in zip(a[3], b[3], strict=True)
    )
    return a[:3] == b[:3] and grads_equal


def test_bad_input_and_model_left_as_found() -> None:
    model = captum_net().train()
    model[0].weight.requires_grad_(False)
    model[6].weight.grad = torch.ones_like(model[6].weight)
    torch.manual_seed(4)
    x = torch.randn(3, 2, 6, 9, dtype=F64)
    before, out = state(model), model(x).detach()
    NeuronGuidedBackprop(model, "3")(x, (0, 1, 5))
    assert same(state(model), before) and torch.equal(model(x), out)
    with pytest.raises(IndexError, match=r"shaped \(4, 5, 7\)"):
        NeuronGuidedBackprop(model, "3")(x, (4, 0, 0))
    with pytest.raises(IndexError, match="one index per axis"):
        NeuronGuidedBackprop(model, "3")(x, (1, 0))

    def broken(layer_output: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("a neuron callable that fails")

    with pytest.raises(ZeroDivisionError, match="fails"):
        NeuronGuidedBackprop(model, "3")(x, broken)
    assert same(state(model), before) and torch.equal(model(x), out)
    with pytest.raises(ModuleNotFoundInModelError, match="not a module of the model"):
        NeuronGuidedBackprop(model, "conv9")
