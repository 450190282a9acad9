"""NeuronGradient: hand-worked values, captum parity (float64), bad neurons, the model left as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import NeuronGradient


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def test_hand_worked_linear_relu() -> None:
    model = nn.Sequential(nn.Linear(3, 2, bias=False), nn.ReLU())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 2.0, -1.0]])
    # neuron 0 after the ReLU: 1 - 2 + 0.5 < 0 for item 0 (cut), 1 - 4 - 0.5 < 0 for item 1 (cut)
    with pytest.warns(UserWarning, match="all zero"):
        got = NeuronGradient(model, "1")(x, (0,))
    torch.testing.assert_close(got, torch.zeros(2, 3))
    got = NeuronGradient(model, "0")(x, (0,))
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.0, 0.5], [1.0, -2.0, 0.5]]))


def test_callable_neuron_equals_index() -> None:
    model = _mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    by_index = NeuronGradient(model, "2")(x, (1,))
    by_callable = NeuronGradient(model, "2")(x, lambda y: y[:, 1])
    torch.testing.assert_close(by_index, by_callable, rtol=0, atol=0)
    w1, w2 = model[0].weight, model[2].weight
    on = (x @ w1.T + model[0].bias > 0).double()
    slow = (on * w2[1]) @ w1  # d y_1 / d x = sum_j w2[1, j] relu'(h_j) w1[j, :]
    torch.testing.assert_close(by_index, slow, rtol=1e-12, atol=1e-12)


def test_captum_parity_image() -> None:
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 5, 4)).double()
    x = torch.randn(2, 2, 5, 7, dtype=torch.float64)
    ours = NeuronGradient(model, "0")(x, (2, 1, -2))
    theirs = captum.NeuronGradient(model, model[0]).attribute(x, (2, 1, -2))
    assert ours.abs().sum() > 0 and ours.shape == (2, 2, 5, 7)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_bad_neuron_and_model_left_as_found() -> None:
    model = _mlp().train()
    x = torch.randn(2, 5, dtype=torch.float64)
    before = model(x)
    with pytest.raises(IndexError, match="not an index into one item"):
        NeuronGradient(model, "2")(x, (3, 0))
    with pytest.raises(IndexError, match="shaped"):
        NeuronGradient(model, "2")(x, (7,))
    assert model.training and all(not m._forward_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model(x), before)
