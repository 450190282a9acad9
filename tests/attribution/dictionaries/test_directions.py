"""steer, ablate_direction, diff_means: the added vector appears exactly, nothing else changes."""

from __future__ import annotations

import pytest
import torch

from attribution import ablate_direction, diff_means, record, steer
from tests.support import hook_state


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


X = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
V = torch.tensor([0.5, -2.0, 1.0, 3.0], dtype=torch.float64)


def test_steer_adds_exactly_the_scaled_vector_at_the_given_positions_only(model):
    before = hook_state(model)
    with torch.no_grad(), record(model, ["0", "2"]) as plain:
        model(X)
    with torch.no_grad(), steer(model, {"0": V}, scale=1.5, positions=[1, 3]), record(model, ["0", "2"]) as acts:
        model(X)
    delta = acts["0"] - plain["0"]
    torch.testing.assert_close(delta[:, [1, 3]], (1.5 * V).expand(2, 2, 4), rtol=0, atol=1e-15)
    assert torch.equal(delta[:, [0, 2, 4]], torch.zeros(2, 3, 4, dtype=torch.float64))
    assert torch.equal(acts["2"][:, 0], plain["2"][:, 0]) and not torch.equal(acts["2"][:, 1], plain["2"][:, 1])
    with torch.no_grad(), steer(model, {"0": V}), record(model, "0") as everywhere:
        model(X)
    torch.testing.assert_close(everywhere["0"] - plain["0"], V.expand(2, 5, 4), rtol=0, atol=1e-15)
    assert hook_state(model) == before


def test_ablate_direction_removes_the_unit_component_and_keeps_the_rest(model):
    with torch.no_grad(), ablate_direction(model, {"0": 7.0 * V}), record(model, "0") as acts:
        model(X)
    unit = V / V.norm()
    raw = model[0](X).detach()
    torch.testing.assert_close(acts["0"] @ unit, torch.zeros(2, 5, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(acts["0"], raw - (raw @ unit)[..., None] * unit, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="is zero"), ablate_direction(model, {"0": torch.zeros(4)}):
        pass


def test_diff_means_is_the_difference_of_the_hand_means_at_a_position_or_all(model):
    a, b = [X[:1], X[1:]], [X * 2]
    model.train()
    h_a = model[0](torch.cat(a)).detach()
    h_b = model[0](torch.cat(b)).detach()
    last = diff_means(model, a, b, "0")
    torch.testing.assert_close(last, h_a[:, -1].mean(0) - h_b[:, -1].mean(0), rtol=0, atol=1e-14)
    every = diff_means(model, a, b, "0", position=None)
    torch.testing.assert_close(every, h_a.reshape(-1, 4).mean(0) - h_b.reshape(-1, 4).mean(0), rtol=0, atol=1e-14)
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())


def test_a_vector_of_the_wrong_width_is_refused_naming_both(model):
    with pytest.raises(ValueError, match=r"has 3 entries, but the site's activations have width 4"):
        with steer(model, {"0": torch.ones(3)}):
            model(X)
