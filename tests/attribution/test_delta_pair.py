"""``return_delta=True`` returns one type from every method with a delta: a pair that unpacks, with named fields.

captum's users write ``attributions, delta = dl.attribute(x, return_delta=True)``; the same line works here for
IntegratedGradients, DeepLift, DeepLiftShap and GradientShap. Each delta is checked against the definition
``sum(attributions) - (S(x) - S(baseline))`` computed here from the model's own outputs, on a float64 net with both
signs in its weights and a non-square input (batch 3, 5 features, 4 classes).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from attribution import DeepLift, DeepLiftShap, GradientShap, IntegratedGradients
from attribution.reference import AttributionsWithDelta, draw

F64 = torch.float64
TARGETS = [2, 0, 3]


class TanhNet(nn.Module):
    """``(batch, 5) -> (batch, 4)``, its tanh called as a function.

    DeepLift's rules do not see a function call, so every method has non-zero deltas here: a delta that were not
    computed from the model's scores would show.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.hidden, self.out = nn.Linear(5, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def tanh_net() -> nn.Module:
    return TanhNet().double().eval()


def scores(model: nn.Module, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """``S(x)``: the target logits, one per row, ``(rows,)``."""
    with torch.no_grad():
        return model(x)[torch.arange(len(targets)), targets]


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs ``(3, 5)``, one baseline ``(5,)`` and a set of four references ``(4, 5)``, of both signs."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, dtype=F64, generator=generator) * 2
    return x, torch.randn(5, dtype=F64, generator=generator), torch.randn(4, 5, dtype=F64, generator=generator)


def expected_gain(name: str, model: nn.Module, x: torch.Tensor, b: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """``S(x) - S(baseline)`` per item, with ``S(baseline)`` averaged as each method defines it."""
    sx = scores(model, x, TARGETS)
    if name in ("IntegratedGradients", "DeepLift"):
        return sx - scores(model, b.expand_as(x), TARGETS)
    if name == "DeepLiftShap":
        per_ref = torch.stack([scores(model, r.expand_as(x), TARGETS) for r in refs], 1)
        return sx - per_ref.mean(1)
    index = draw(3, 6, 4, (5,), 0.0, 1).index.view(3, 6)  # GradientShap: the references drawn for each item
    drawn = torch.stack([scores(model, refs[index[:, j]], TARGETS) for j in range(6)], 1)
    return sx - drawn.mean(1)


def methods(model: nn.Module, b: torch.Tensor, refs: torch.Tensor) -> dict[str, Callable[..., object]]:
    return {
        "IntegratedGradients": IntegratedGradients(model, steps=3, method="riemann_left", baseline=b),
        "DeepLift": DeepLift(model, b),
        "DeepLiftShap": DeepLiftShap(model, refs),
        "GradientShap": GradientShap(model, refs, samples=6, seed=1),
    }


@pytest.mark.parametrize("name", ["IntegratedGradients", "DeepLift", "DeepLiftShap", "GradientShap"])
def test_return_delta_unpacks_as_a_pair_with_the_named_fields(name: str) -> None:
    model = tanh_net()
    x, b, refs = inputs()
    method = methods(model, b, refs)[name]
    result = method(x, target=TARGETS, return_delta=True)
    assert type(result) is AttributionsWithDelta
    attributions, delta = result  # captum's line
    assert attributions is result.attributions and delta is result.delta
    assert len(result) == 2 and result[0] is attributions and result[1] is delta
    torch.testing.assert_close(attributions, method(x, target=TARGETS), rtol=0, atol=0)  # the plain call's values
    assert attributions.shape == (3, 5) and delta.shape == (3,)
    gain = expected_gain(name, model, x, b, refs)
    torch.testing.assert_close(delta, attributions.sum(1) - gain, rtol=1e-12, atol=1e-12)
    assert delta.abs().min() > 1e-3, "the deltas must be non-zero for the check to mean something"


# -- ported from captum's tests/attr/test_deeplift_basic.py, in captum's own lines --------------------------------
class ReLUDeepLiftModel(nn.Module):
    """``2 relu(x_0) + 2 relu(x_1 - 1.5)``, captum's two-input model with its inputs as the two columns."""

    def __init__(self) -> None:
        super().__init__()
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.relu1(x[:, :1]) + 2 * self.relu2(x[:, 1:] - 1.5)


class LinearMaxPoolLinearModel(nn.Module):
    """captum's: the identity, a max pool over the 4 features, then a weight of 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4, bias=False)
        self.lin1.weight = nn.Parameter(torch.eye(4))
        self.pool1 = nn.MaxPool1d(4)
        self.lin2 = nn.Linear(1, 1, bias=False)
        self.lin2.weight = nn.Parameter(torch.ones(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.pool1(self.lin1(x).unsqueeze(1)).squeeze(1))


def test_lin_maxpool_lin_classification_as_captum_writes_it() -> None:
    inputs = torch.ones(2, 4)
    baselines = torch.tensor([[1, 2, 3, 9], [4, 8, 6, 7]]).float()
    dl = DeepLift(LinearMaxPoolLinearModel(), baselines)
    attributions, delta = dl(inputs, target=0, return_delta=True)
    expected = torch.tensor([[0.0, 0.0, 0.0, -8.0], [0.0, -7.0, 0.0, 0.0]])
    torch.testing.assert_close(attributions, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(delta, torch.zeros(2), rtol=0, atol=1e-4)


def test_relu_deeplift_exact_match_as_captum_writes_it() -> None:
    dl = DeepLift(ReLUDeepLiftModel())
    attributions, delta = dl(torch.tensor([[1.0, 2.0]]), target=0, return_delta=True)
    assert attributions[0, 0] == 2.0 and attributions[0, 1] == 1.0
    assert delta[0] == 0.0
