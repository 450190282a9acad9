"""Random projections: the projected loop gradients, the same matrix in every process, the JL bound, bounded blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from attribution.influence import RandomProjection, per_example_gradients
from attribution.influence import projection as projection_module

ROOT = Path(__file__).resolve().parents[3]
CE = nn.CrossEntropyLoss(reduction="none")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_projected_gradients_equal_the_projected_loop_gradients(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 2, 1, 2])
    projection = RandomProjection(3, kind=kind, seed=7)
    projected = per_example_gradients(model, (x, y), CE, projection=projection)
    for i in range(4):
        grads = torch.autograd.grad(CE(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            expected = projection.matrix(name, g.numel()).double() @ g.reshape(-1)
            torch.testing.assert_close(projected[name][i], expected, rtol=1e-12, atol=1e-14)
    assert all(v.shape == (4, 3) for v in projected.values())


@pytest.mark.slow
def test_the_matrix_is_the_same_in_another_process_and_differs_by_name_and_seed():
    here = RandomProjection(16, seed=3).matrix("layer.weight", 50)
    code = (
        "import json; from attribution.influence import RandomProjection; "
        "print(json.dumps(RandomProjection(16, seed=3).matrix('layer.weight', 50).mul(4).tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert torch.tensor(json.loads(out), dtype=torch.float32).equal(here.mul(4))
    assert set(here.mul(4).unique().tolist()) == {-1.0, 1.0}  # +-1 / sqrt(16)
    assert not torch.equal(here, RandomProjection(16, seed=4).matrix("layer.weight", 50))
    assert not torch.equal(here, RandomProjection(16, seed=3).matrix("layer.bias", 50))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_inner_products_within_the_johnson_lindenstrauss_bound(kind):
    dim, size = 256, 3000
    g = torch.randn(24, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g[12:] += g[:12]  # correlated pairs as well as near-orthogonal ones
    projected = RandomProjection(dim, kind=kind, seed=0)("w", g)
    norms = g.norm(dim=1)
    error = (projected @ projected.T - g @ g.T) / (norms[:, None] * norms[None])
    # each error has standard deviation at most sqrt(2 / dim); 276 pairs, none beyond 4 of them
    assert error.abs().max() < 4 * (2 / dim) ** 0.5
    assert error.square().mean().sqrt() < 1.3 * (2 / dim) ** 0.5  # and their spread is of the stated size


def test_blocks_stay_bounded_and_add_up_to_the_matrix(monkeypatch):
    monkeypatch.setattr(projection_module, "_BLOCK", 40)
    projection = RandomProjection(8)
    blocks = list(projection.blocks("w", 23))
    assert [start for start, _ in blocks] == [0, 5, 10, 15, 20] and all(b.numel() <= 40 for _, b in blocks)
    g = torch.randn(3, 23, dtype=torch.float64)
    torch.testing.assert_close(projection("w", g), g @ projection.matrix("w", 23).double().T)


def test_dim_larger_than_the_gradient_is_refused():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"`dim`=4 is larger than the gradient of 'bias' \(2 numbers\)"):
        per_example_gradients(model, (torch.randn(2, 3), torch.tensor([0, 1])), CE, projection=RandomProjection(4))
    with pytest.raises(ValueError, match="`kind`"):
        RandomProjection(4, kind="sparse")
