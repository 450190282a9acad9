"""FGSM and PGD against captum 0.9's ``robust.FGSM`` and ``robust.PGD``, live, in float64.

The random start draws from a generator seeded with ``seed``; captum draws from the global random state, seeded
here with the same number, in the same order, so both start from the same point. captum's L2 random start
broadcasts its per-item radii against the last axis, which works for one item only: that case is compared with one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.robust import fgsm, pgd

robust = pytest.importorskip("captum.robust")

pytestmark = [
    pytest.mark.peers,
    pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients:UserWarning"),  # captum
    pytest.mark.filterwarnings("ignore:Input Tensor 1 did not already require gradients:UserWarning"),
]


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4), nn.Softmax(dim=1)).double().eval()


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 6, dtype=torch.float64)


@pytest.mark.parametrize("targeted", [False, True])
@pytest.mark.parametrize("bounds", [(-float("inf"), float("inf")), (-0.5, 0.8)])
def test_fgsm_equals_captums(model, x, targeted, bounds):
    mask = (torch.arange(6) % 3 != 0).double().expand(3, 6)
    for kwargs in ({}, {"mask": mask}):
        ours = fgsm(
            model, x, [0, 3, 1], epsilon=0.07, targeted=targeted, lower_bound=bounds[0], upper_bound=bounds[1], **kwargs
        )
        theirs = robust.FGSM(model, lower_bound=bounds[0], upper_bound=bounds[1]).perturb(
            x, 0.07, [0, 3, 1], targeted=targeted, **kwargs
        )
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("norm", ["Linf", "L2"])
@pytest.mark.parametrize("targeted", [False, True])
def test_pgd_equals_captums(model, x, norm, targeted):
    options = {"step_size": 0.05, "steps": 7, "norm": norm, "targeted": targeted}
    ours = pgd(model, x, [2, 2, 0], epsilon=0.2, lower_bound=-1.2, upper_bound=1.2, **options)
    theirs = robust.PGD(model, lower_bound=-1.2, upper_bound=1.2).perturb(
        x, 0.2, 0.05, 7, [2, 2, 0], targeted=targeted, norm=norm
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-15)


@pytest.mark.parametrize(("norm", "items"), [("Linf", 3), ("L2", 1)])
def test_pgd_random_start_equals_captums(model, x, norm, items):
    x = x[:items]
    ours = pgd(model, x, 1, epsilon=0.3, step_size=0.05, steps=3, norm=norm, random_start=True, seed=7)
    torch.manual_seed(7)
    theirs = robust.PGD(model).perturb(x, 0.3, 0.05, 3, 1, norm=norm, random_start=True)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-15)


def test_pgd_of_two_inputs_with_a_loss_equals_captums():
    torch.manual_seed(2)
    left, right = nn.Linear(3, 4).double(), nn.Linear(2, 4).double()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = left, right

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.left(a)) + self.right(b)  # logits

    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    loss = nn.CrossEntropyLoss(reduction="none")
    ours = pgd(Two().eval(), (a, b), [3, 0], epsilon=0.3, step_size=0.1, steps=4, norm="L2", loss=loss)
    theirs = robust.PGD(Two().eval(), loss).perturb((a, b), 0.3, 0.1, 4, torch.tensor([3, 0]), norm="L2")
    for mine, captums in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, captums, rtol=0, atol=1e-15)
