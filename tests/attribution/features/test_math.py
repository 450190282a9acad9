"""The sampling keys, moments, sketch and co-activation sums of the non-zero entries against dense brute force."""

from __future__ import annotations

import pytest
import torch

from attribution.features import Directions, _math, feature_statistics

P = 2_147_483_647


def _brute_smallest(place, offsets, eligible, ceiling, size):
    """Per unit, sorted by key: the eligible places up to the ceiling with the ``size`` smallest keys and ties."""
    out = []
    for u in range(len(offsets)):
        keys = (place + offsets[u]) % P
        entries = sorted((int(keys[i]), i) for i in range(len(place)) if eligible[u, i] and keys[i] <= ceiling[u])
        if len(entries) > size:
            entries = [e for e in entries if e[0] <= entries[size - 1][0]]
        out += [(u, i, key) for key, i in entries]
    return sorted(out)


@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("density", [0.02, 0.3, 1.0])
def test_smallest_keys_equal_brute_force_with_ties_wraps_ceilings_and_short_windows(size, density):
    torch.manual_seed(size)
    n, units = 157, 40
    place = torch.randint(0, P, (n,))
    place[10:20] = place[5]  # ties among the places' keys
    offsets = torch.randint(0, P, (units,))
    offsets[0], offsets[1] = 0, P - 1 - int(place.max())  # no wrap; a wrap at the largest place
    offsets[4] = P - int(place[7])  # place 7 has key 0: the unit's window starts there
    eligible = torch.rand(units, n) < density
    eligible[2] = False  # a unit with nothing eligible
    eligible[3, :] = False
    eligible[3, -1] = True  # one eligible place, far from most windows
    ceiling = torch.where(torch.rand(units) < 0.5, 2**62, torch.randint(0, P, (units,)))
    unit, index, key = _math.smallest_keys(place, offsets, eligible, ceiling, size)
    got = sorted(zip(unit.tolist(), index.tolist(), key.tolist(), strict=True))
    assert got == _brute_smallest(place, offsets, eligible, ceiling, size)


def test_ties_and_ceilings_past_the_window_are_read_to_the_end():
    """150 places share the smallest key: the window (4 x size + 28 places) ends inside the tie."""
    place = torch.cat([torch.full((150,), 1000), torch.arange(2000, 2050)])
    offsets = torch.zeros(3, dtype=torch.long)
    eligible = torch.ones(3, 200, dtype=torch.bool)
    eligible[1:, :150] = False
    eligible[1:, 100] = True  # only one of the tied places, past the window, is eligible
    ceiling = torch.tensor([2**62, 1000, 999])  # unit 2's ceiling is below every key
    unit, index, _ = _math.smallest_keys(place, offsets, eligible, ceiling, 1)
    assert sorted(index[unit == 0].tolist()) == list(range(150))  # all ties with the first
    assert index[unit == 1].tolist() == [100]
    assert not (unit == 2).any()


def test_keys_are_the_places_keys_plus_the_units_offsets():
    grid = _math.keys(7, torch.tensor([0, 3]), torch.tensor([2, 5]), torch.arange(4))
    place = _math.place_keys(7, torch.tensor([2, 5]), torch.arange(4))
    offsets = _math.unit_offsets(7, torch.tensor([0, 3]))
    assert torch.equal(grid, (place[None] + offsets[:, None, None]) % P)
    assert int(grid.max()) < P and int(grid.min()) >= 0


def _sparse(units=7, columns=300, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(units, columns) * 3
    x[torch.rand(units, columns) < 0.8] = 0.0
    x[2] = 0.0  # a unit that never fires
    x[4] = x[4].abs()
    return x


def test_entry_moments_equal_the_dense_moments_with_zeros_and_empty_units():
    x = _sparse()
    included = torch.rand(x.shape) < 0.9
    included[5] = False  # a unit with nothing included
    unit, place = (included & (x != 0)).nonzero(as_tuple=True)
    got = _math.entry_moments(unit, x[unit, place], included.sum(1))
    want = _math.moments(x, included)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)
    assert got[0, 5] == 0 and got[1, 5] == 0


def test_sketch_counts_equal_the_bucket_counts_of_every_value():
    x = _sparse()
    unit, place = (x != 0).nonzero(as_tuple=True)
    got = _math.sketch_counts(unit, x[unit, place], (x == 0).sum(1))
    want = torch.stack([torch.bincount(_math.bucket(row), minlength=_math.BUCKETS) for row in x])
    assert torch.equal(got, want)


def test_entry_coactivation_equals_the_dense_sums_exactly():
    x = _sparse(columns=9000)  # more columns than one dense chunk of 2^13
    unit, place = (x != 0).nonzero(as_tuple=True)
    index, product, sums = _math.entry_coactivation(unit, place, x[unit, place], x.shape[0])
    gram = torch.zeros(x.shape[0] ** 2, dtype=torch.long).index_add_(0, index, product).reshape(x.shape[0], -1)
    dense_gram, dense_sums = _math.coactivation(x)
    assert torch.equal(gram, dense_gram) and torch.equal(sums, dense_sums)


def test_too_many_pairs_take_the_dense_sums_with_the_same_neighbours(planted, monkeypatch):
    model, ids, _ = planted
    units = Directions(torch.randn(5, 6), "embed")
    sparse = feature_statistics(model, ids, units, k=2, bands=0, coactivation=True, batch_size=4, progress=False)
    monkeypatch.setattr(_math, "MAX_PAIRS", 0)
    dense = feature_statistics(model, ids, units, k=2, bands=0, coactivation=True, batch_size=4, progress=False)
    assert torch.equal(sparse.first.gram, dense.first.gram) and torch.equal(sparse.first.sums, dense.first.sums)
    assert int(sparse.first.gram.abs().sum()) > 0
