"""Path patching on a two-path residual model, each sender cell's effect through the chosen path written out.

``h1 = a(x)``, ``h2 = tanh(b(x + h1))``, ``s = r(x + h1 + h2)``, output ``head(cumsum(s))``: ``a`` reaches the
output directly (through ``r``) and through ``b``. Freezing ``b`` keeps only the direct path; receiving at ``b``
keeps only the path through ``b``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import path_patching


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.r = nn.Identity()
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.a(x)
        h2 = torch.tanh(self.b(x + h1))
        return self.head(self.r(x + h1 + h2).cumsum(dim=1))


WEIGHTS = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], dtype=torch.float64)


def metric(out: torch.Tensor) -> torch.Tensor:
    return (WEIGHTS * (out[..., 0] - 0.3 * out[..., 1])).sum()


@pytest.fixture
def setup():
    torch.manual_seed(6)
    model = Toy().double().eval()
    return model, torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)


def h1_patched(model: Toy, base: torch.Tensor, source: torch.Tensor, position: int) -> torch.Tensor:
    h1 = model.a(base)
    h1[:, position] = model.a(source)[:, position]
    return h1


@torch.no_grad()
def direct(model, base, source, position, receiver_positions=None):
    """Receiver ``r``, ``b`` frozen: ``r`` gets ``x + h1' + h2(base)`` (at ``receiver_positions`` only)."""
    h1 = model.a(base)
    h2 = torch.tanh(model.b(base + h1))
    received = base + h1_patched(model, base, source, position) + h2
    s = base + h1 + h2
    rows = slice(None) if receiver_positions is None else receiver_positions
    s[:, rows] = received[:, rows]
    return metric(model.head(s.cumsum(dim=1)))


@torch.no_grad()
def through_b(model, base, source, position):
    """Receiver ``b`` (input): ``b`` gets ``x + h1'``, the direct path keeps ``h1`` of ``base``."""
    h1 = model.a(base)
    h2 = torch.tanh(model.b(base + h1_patched(model, base, source, position)))
    return metric(model.head((base + h1 + h2).cumsum(dim=1)))


def test_direct_path_only_when_the_other_path_is_frozen(setup):
    model, base, source = setup
    got = path_patching(model, base, source, "a", "r", metric, freeze=["b"], progress=False)
    expected = torch.stack([direct(model, base, source, p) for p in range(3)])
    torch.testing.assert_close(got[0].double(), expected.float().double())


def test_path_through_the_receiver_only(setup):
    model, base, source = setup
    got = path_patching(model, base, source, "a", "b", metric, progress=False)
    expected = torch.stack([through_b(model, base, source, p) for p in range(3)])
    torch.testing.assert_close(got[0].double(), expected.float().double())


def test_receiver_positions_patch_only_those_positions(setup):
    model, base, source = setup
    got = path_patching(model, base, source, "a", "r", metric, freeze=["b"], receiver_positions=[2, 0], progress=False)
    expected = torch.stack([direct(model, base, source, p, [2, 0]) for p in range(3)])
    torch.testing.assert_close(got[0].double(), expected.float().double())


def test_chosen_cells_only_and_normalised(setup):
    model, base, source = setup
    got = path_patching(model, base, source, "a", "b", metric, only=[(0, 2)], normalize=True, progress=False)
    with torch.no_grad():
        low, high = metric(model(base)), metric(model(source))
    assert got[0, :2].isnan().all()
    torch.testing.assert_close(
        got[0, 2].double(), ((through_b(model, base, source, 2) - low) / (high - low)).float().double()
    )


def test_a_receiver_is_not_frozen_at_its_receiving_site(setup):
    """``b`` in ``freeze`` and receiving at its output: it receives, so the path through it stays open."""
    model, base, source = setup
    got = path_patching(model, base, source, "a", "b", metric, freeze=["b"], receiver_site="output", progress=False)
    expected = torch.stack([through_b(model, base, source, p) for p in range(3)])
    torch.testing.assert_close(got[0].double(), expected.float().double())


def test_only_the_cells_sender_is_patched_and_cells_index_the_result(setup):
    """Senders ``a`` and ``b`` (rows 0 and 1), nothing frozen, receiver ``r``: cell (1, 0) patches ``b`` alone."""
    model, base, source = setup
    got = path_patching(model, base, source, ["a", "b"], "r", metric, freeze=(), only=[(1, 0), (0, 1)], progress=False)
    with torch.no_grad():
        h1 = model.a(base)
        pre = model.b(base + h1)
        pre[:, 0] = model.b(source + model.a(source))[:, 0]
        by_b = metric(model.head((base + h1 + torch.tanh(pre)).cumsum(dim=1)))
        h1_cell = h1_patched(model, base, source, 1)
        by_a = metric(model.head((base + h1_cell + torch.tanh(model.b(base + h1_cell))).cumsum(dim=1)))
    assert got.shape == (2, 3)
    assert got.isnan().sum() == 4
    torch.testing.assert_close(got[1, 0].double(), by_b.float().double())
    torch.testing.assert_close(got[0, 1].double(), by_a.float().double())
