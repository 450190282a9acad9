"""Interventions against pyvene's formulas (ported slowly, float64), and their known answers."""

from __future__ import annotations

import itertools

import pytest
import torch

from attribution.causal.interventions import BoundlessSubspace, LowRankSubspace, RotatedSubspace


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


def pair(dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 3, dim, generator=g, dtype=torch.float64) + 0.5  # asymmetric, both signs
    return base, torch.randn(2, 3, dim, generator=g, dtype=torch.float64) * 2 - 1


def pyvene_rotated(base, source, weight, k):
    """pyvene's RotatedSpaceIntervention, one vector at a time: rotate by ``x @ W``, swap ``[:k]``, ``@ W.T``."""
    out = torch.empty_like(base)
    for idx in itertools.product(*map(range, base.shape[:-1])):
        rb, rs = base[idx] @ weight, source[idx] @ weight
        mixed = rb.clone()
        for i in range(k):
            mixed[i] = rs[i]
        out[idx] = mixed @ weight.T
    return out


def pyvene_boundless(base, source, weight, boundary, temperature):
    """pyvene's BoundlessRotatedSpaceIntervention with its ``sigmoid_boundary`` written out coordinate by coordinate."""
    dim = base.shape[-1]
    b_high = min(max(boundary, 1e-3), 1.0) * dim
    mask = [
        1
        / (1 + torch.exp(torch.tensor(-(i - 0.0) / temperature, dtype=torch.float64)))
        * 1
        / (1 + torch.exp(torch.tensor(-(b_high - i) / temperature, dtype=torch.float64)))
        for i in range(dim)
    ]
    out = torch.empty_like(base)
    for idx in itertools.product(*map(range, base.shape[:-1])):
        rb, rs = base[idx] @ weight, source[idx] @ weight
        mixed = torch.stack([(1 - mask[i]) * rb[i] + mask[i] * rs[i] for i in range(dim)])
        out[idx] = mixed @ weight.T
    return out


def pyvene_low_rank(base, source, weight):
    """pyvene's LowRankRotatedSpaceIntervention: ``b + (s W - b W) W^T`` with ``W`` ``(dim, k)``."""
    out = torch.empty_like(base)
    for idx in itertools.product(*map(range, base.shape[:-1])):
        out[idx] = base[idx] + (source[idx] @ weight - base[idx] @ weight) @ weight.T
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_rotated_equals_pyvene_on_the_same_rotation(k):
    iv = RotatedSubspace(5, k).double()
    rotation = random_orthogonal(5, 1)
    iv.rotation = rotation
    base, source = pair(5)
    torch.testing.assert_close(iv.rotation, rotation, rtol=0, atol=1e-12)
    torch.testing.assert_close(iv(base, source), pyvene_rotated(base, source, rotation.T, k), rtol=0, atol=1e-12)


def test_rotated_with_the_identity_and_every_coordinate_is_plain_patching():
    iv = RotatedSubspace(4, 4).double()
    iv.rotation = torch.eye(4, dtype=torch.float64)
    base, source = pair(4)
    torch.testing.assert_close(iv(base, source), source, rtol=0, atol=0)


def test_rotated_with_k_zero_leaves_the_base():
    iv = RotatedSubspace(4, 0).double()
    iv.rotation = random_orthogonal(4, 2)
    base, source = pair(4)
    torch.testing.assert_close(iv(base, source), base, rtol=0, atol=1e-12)


def test_rotated_swaps_only_the_subspace_spanned_by_the_first_rows():
    iv = RotatedSubspace(4, 2).double()
    rotation = random_orthogonal(4, 3)
    iv.rotation = rotation
    base, source = pair(4)
    out = iv(base, source)
    top, rest = rotation[:2], rotation[2:]
    torch.testing.assert_close(out @ top.T, source @ top.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(out @ rest.T, base @ rest.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("boundary", "temperature"), [(0.5, 50.0), (0.3, 0.1), (2.0, 1.0), (-1.0, 0.5)])
def test_boundless_equals_pyvene_with_beta_clamped(boundary, temperature):
    iv = BoundlessSubspace(6, temperature=temperature).double()
    rotation = random_orthogonal(6, 4)
    iv.rotation = rotation
    with torch.no_grad():
        iv.beta.fill_(boundary)
        iv.temperature.fill_(temperature)  # float64 0.1, not float32 0.1 widened by .double()
    base, source = pair(6)
    expected = pyvene_boundless(base, source, rotation.T, boundary, temperature)
    torch.testing.assert_close(iv(base, source), expected, rtol=0, atol=1e-12)


def test_boundless_at_a_low_temperature_is_a_hard_swap_of_the_first_coordinates():
    iv = BoundlessSubspace(6, temperature=1e-3).double()
    iv.rotation = random_orthogonal(6, 5)
    with torch.no_grad():
        iv.beta.fill_(0.5 + 0.5 / 6)  # b_high = 3.5: coordinates 1, 2, 3 fully swapped; 0 half (sigmoid(0))
    mask = iv.mask()
    torch.testing.assert_close(mask, torch.tensor([0.5, 1, 1, 1, 0, 0], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_low_rank_equals_pyvene(k):
    iv = LowRankSubspace(4, k).double()
    rows = random_orthogonal(4, 6)[:k]
    iv.rotation = rows
    base, source = pair(4)
    torch.testing.assert_close(iv(base, source), pyvene_low_rank(base, source, rows.T), rtol=0, atol=1e-12)


def test_low_rank_of_full_rank_is_plain_patching_and_matches_rotated():
    rotation = random_orthogonal(4, 7)
    low, full = LowRankSubspace(4, 4).double(), RotatedSubspace(4, 2).double()
    low.rotation, full.rotation = rotation, rotation
    base, source = pair(4)
    torch.testing.assert_close(low(base, source), source, rtol=0, atol=1e-12)
    low2 = LowRankSubspace(4, 2).double()
    low2.rotation = rotation[:2]
    torch.testing.assert_close(low2(base, source), full(base, source), rtol=0, atol=1e-12)


def test_rotation_stays_orthogonal_through_optimisation():
    torch.manual_seed(0)
    iv = RotatedSubspace(5, 2)
    opt = torch.optim.Adam(iv.parameters(), lr=0.1)
    base, source = (t.float() for t in pair(5))
    for _ in range(20):
        opt.zero_grad()
        iv(base, source).pow(3).sum().backward()
        opt.step()
    r = iv.rotation.detach()
    torch.testing.assert_close(r @ r.T, torch.eye(5), rtol=0, atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"`k` must be an int in \[0, dim=3\]"):
        RotatedSubspace(3, 4)
    with pytest.raises(ValueError, match="at least 1"):
        LowRankSubspace(3, 0)
    iv = RotatedSubspace(3, 1)
    with pytest.raises(ValueError, match="orthonormal rows"):
        iv.rotation = torch.ones(3, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        iv.rotation = torch.eye(2)
    with pytest.raises(ValueError, match="build it with dim=4"):
        iv(torch.zeros(1, 4), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="the base's shape"):
        iv(torch.zeros(1, 3), torch.zeros(2, 3))
