"""Exact activation patching against patching done by hand, cell by cell, on a model that mixes positions.

The model mixes positions after the patched layer (a cumulative sum over positions), so that patching position 1
changes positions 1 and 2 of the output and the cells differ; both directions, normalised and per-example values,
heads, and several cells per forward are checked against the same hand-made patch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import activation_patching


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(3, 4)
        self.act = nn.Tanh()
        self.down = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)).cumsum(dim=1))  # (batch, positions, 2)


WEIGHTS = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], dtype=torch.float64)


def per_item(out: torch.Tensor) -> torch.Tensor:
    return (WEIGHTS * (out[..., 0] - out[..., 1])).sum(1)


def metric(out: torch.Tensor) -> torch.Tensor:
    return per_item(out).sum()


@pytest.fixture
def setup():
    torch.manual_seed(4)
    model = Mixer().double().eval()
    return model, torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)


def patched(model: Mixer, source: torch.Tensor, target: torch.Tensor, index, score=metric) -> torch.Tensor:
    """``score`` of ``target``'s run with ``up``'s output at ``index`` taken from ``source``'s run."""
    with torch.no_grad():
        a = model.up(target)
        a[index] = model.up(source)[index]
        return score(model.down(model.act(a).cumsum(dim=1)))


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("cells_per_forward", [1, 2])
def test_each_position_is_patched_alone(setup, direction, cells_per_forward):
    model, clean, corrupted = setup
    source, target = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    got = activation_patching(
        model, clean, corrupted, "up", metric, direction=direction, cells_per_forward=cells_per_forward, progress=False
    )
    expected = torch.stack([patched(model, source, target, (slice(None), p)) for p in range(3)])
    torch.testing.assert_close(got[0].double(), expected.float().double())


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_normalised_is_0_for_the_patched_run_and_1_for_the_source(setup, direction):
    model, clean, corrupted = setup
    source, target = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    got = activation_patching(
        model, clean, corrupted, "up", metric, direction=direction, normalize=True, progress=False
    )
    with torch.no_grad():
        low, high = metric(model(target)), metric(model(source))
    values = torch.stack([patched(model, source, target, (slice(None), p)) for p in range(3)])
    torch.testing.assert_close(got[0].double(), ((values - low) / (high - low)).float().double())


def test_heads_and_positions_per_example(setup):
    """Heads split the 4 features in 2 halves; cells ``(positions, heads, batch)``."""
    model, clean, corrupted = setup
    got = activation_patching(model, clean, corrupted, "up", per_item, heads=2, per_example=True, progress=False)
    assert got.shape == (1, 3, 2, 2)
    for p in range(3):
        for h in range(2):
            features = slice(2 * h, 2 * h + 2)
            expected = patched(model, clean, corrupted, (slice(None), p, features), per_item)
            torch.testing.assert_close(got[0, p, h].double(), expected.float().double())
