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


class _Sequence(nn.Module):
    """Tokens -> embedding -> a linear layer -> tanh -> a linear layer (or HF ``Conv1D``) per position."""

    def __init__(self, last: nn.Module) -> None:
        super().__init__()
        self.embed, self.up, self.last = nn.Embedding(11, 6, padding_idx=3), nn.Linear(6, 9), last

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.up(self.embed(ids))))


def _sequence_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out.transpose(1, 2), batch[1], reduction="none").sum(-1)


@pytest.mark.parametrize("last", ["linear", "hf_conv1d"])
@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_structured_projection_equals_the_projected_loop_gradients_on_sequences(last, kind):
    """The factored paths (no (batch, out, in) gradient formed; the embedding from its ids) equal P_rows G P_cols^T."""
    torch.manual_seed(0)
    if last == "linear":
        head: nn.Module = nn.Linear(9, 5)
    else:
        head = pytest.importorskip("transformers.pytorch_utils").Conv1D(5, 9)  # weight (in 9, out 5)
        nn.init.normal_(head.bias)
    model = _Sequence(head).double()
    ids, labels = torch.randint(0, 11, (4, 7)), torch.randint(0, 5, (4, 7))  # 7 positions, non-square layers
    ids[0, :2], ids[1, 1], ids[2, 4:6] = 3, 5, 5  # the padding row, and a token used twice in a sequence
    projection = RandomProjection(4, kind=kind, seed=5, structured=True)  # k = 2 per side
    projected = per_example_gradients(model, (ids, labels), _sequence_loss, projection=projection)
    for i in range(4):
        loss = _sequence_loss(model(ids[i : i + 1]), (ids[i : i + 1], labels[i : i + 1])).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            if g.ndim == 2:  # by hand: the Kronecker form of the two seeded factors
                rows, cols = projection.factors(name, *g.shape)
                expected = (rows.double() @ g @ cols.double().T).reshape(-1)
            else:
                expected = projection.matrix(name, g.numel()).double() @ g.reshape(-1)
            torch.testing.assert_close(projected[name][i], expected, rtol=1e-12, atol=1e-14)
    assert all(v.shape == (4, 4) for v in projected.values())


def test_the_structured_form_is_a_kronecker_product_with_entries_of_one_over_sqrt_k():
    projection = RandomProjection(9, seed=2, structured=True)
    rows, cols = projection.factors("w", 4, 5)
    assert rows.shape == (3, 4) and cols.shape == (3, 5)
    assert set(rows.mul(3**0.5).round().unique().tolist()) == {-1.0, 1.0}
    g = torch.randn(2, 4, 5, dtype=torch.float64)
    kron = torch.kron(rows.double(), cols.double())  # (9, 20): entries +-1/3 = +-1/sqrt(dim)
    torch.testing.assert_close(projection("w", g), g.reshape(2, -1) @ kron.T)
    assert not torch.equal(rows, projection.factors("v", 4, 5)[0])  # seeded by name
    square = projection.factors("w", 4, 4)
    assert square is not None and not torch.equal(*square)  # and by side
    left, right = torch.randn(2, 6, 4, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64)
    torch.testing.assert_close(projection.outer("w", left, right), projection("w", left.transpose(1, 2) @ right))
    ids = torch.tensor([[0, 3, 3, 1, 2, 0], [1, 1, 1, 1, 1, 1]])  # ids stand for one-hot rows of a 4-row matrix
    one_hot = nn.functional.one_hot(ids, 4).double()
    torch.testing.assert_close(projection.outer("w", ids, right, rows=4), projection.outer("w", one_hot, right))
    with pytest.raises(ValueError, match="`rows`"):
        projection.outer("w", ids, right)
    # fewer than k = 3 rows: the dense projection, from the factors too
    assert projection.factors("w", 2, 5) is None and projection.factors("w", 5, 2) is None
    small, other = torch.randn(2, 6, 2, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64)
    dense = (small.transpose(1, 2) @ other).reshape(2, -1) @ projection.matrix("w", 10).double().T
    torch.testing.assert_close(projection.outer("w", small, other), dense)


def test_structured_inner_products_stay_within_the_stated_bound():
    """LoGra's Kronecker form is noisier than a dense matrix of the same dim, within 3 sqrt(2 / dim)."""
    spread = {}
    for dim in (256, 1024):
        for structured in (False, True):
            errors = []
            for seed in range(4):
                g = torch.randn(24, 60, 50, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
                g[12:] += g[:12]
                p = RandomProjection(dim, seed=seed, structured=structured)("w", g)
                flat = g.reshape(24, -1)
                norms = flat.norm(dim=1)
                errors.append((p @ p.T - flat @ flat.T) / (norms[:, None] * norms[None]))
            spread[dim, structured] = torch.stack(errors).square().mean().sqrt()
        assert spread[dim, True] < 3 * (2 / dim) ** 0.5
        assert spread[dim, True] < 1.6 * spread[dim, False]  # measured 1.17x at 256, 1.44x at 1024
    assert spread[1024, True] < 0.7 * spread[256, True]  # and it shrinks as 1 / sqrt(dim)


def test_a_structured_dim_must_be_a_square():
    with pytest.raises(ValueError, match=r"must be a square; got 10\. Use 9, 16"):
        RandomProjection(10, structured=True)
    assert "structured=True" in repr(RandomProjection(16, structured=True))
