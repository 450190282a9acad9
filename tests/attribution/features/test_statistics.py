"""feature_statistics on planted activations: exact top examples, statistics, bands and samples against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attribution.features import Directions, UnitReport, _math, feature_statistics

from .conftest import brute_top


def _units() -> Directions:
    return Directions(torch.eye(6), "embed")


def _acts(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table[ids]  # (documents, tokens, units)


@pytest.mark.parametrize("batch_size", [1, 4, 23])
@pytest.mark.parametrize(("k", "gap"), [(5, 0), (7, 3), (3, 11)])
def test_top_examples_equal_brute_force_with_ties_by_document_then_position(planted, batch_size, k, gap):
    model, ids, table = planted
    report = feature_statistics(
        model, ids, _units(), k=k, min_gap=gap, bands=0, batch_size=batch_size, context=(2, 1), progress=False
    )
    expected = brute_top(_acts(table, ids), torch.ones_like(ids, dtype=torch.bool), k, gap)
    for u in range(6):
        got = [(e.value, e.document, e.position) for e in report.top(u)]
        assert got == expected[u], u


def test_min_gap_default_is_the_context_width_and_examples_of_one_document_keep_it(planted):
    model, ids, table = planted
    report = feature_statistics(model, ids, _units(), k=40, bands=0, context=(3, 2), progress=False)
    expected = brute_top(_acts(table, ids), torch.ones_like(ids, dtype=torch.bool), 40, 6)
    for u in range(6):
        top = report.top(u)
        assert [(e.value, e.document, e.position) for e in top] == expected[u]
        for a in top:
            for b in top:
                if a is not b and a.document == b.document:
                    assert abs(a.position - b.position) >= 6


def test_contexts_hold_the_documents_tokens_and_values_cut_at_the_ends(planted):
    model, ids, table = planted
    report = feature_statistics(model, ids, _units(), k=6, bands=0, context=(4, 2), progress=False)
    for u in range(6):
        for e in report.top(u):
            start = max(0, e.position - 4)
            stop = min(ids.shape[1], e.position + 3)
            assert e.tokens == tuple(ids[e.document, start:stop].tolist())
            assert e.activations == tuple(table[ids[e.document, start:stop], u].tolist())
            assert e.tokens[e.offset] == int(ids[e.document, e.position])
            assert e.activations[e.offset] == e.value


def test_statistics_equal_a_dense_float64_computation(planted):
    model, ids, table = planted
    torch.manual_seed(1)
    table = torch.randn(30, 6) * torch.tensor([1.0, 3.0, 0.1, 10.0, 1.0, 2.0]) + torch.tensor([0, 1, -2, 0, 5, 0.0])
    table[:, 5] = table[:, 5].clamp(min=0)
    model.embed.weight.data.copy_(table)
    report = feature_statistics(model, ids, _units(), k=3, bands=0, batch_size=5, progress=False)
    x = table[ids].reshape(-1, 6).double().numpy()
    centred = x - x.mean(0)
    variance = (centred**2).mean(0)
    np.testing.assert_allclose(report.mean.numpy(), x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(report.variance.numpy(), variance, rtol=1e-10)
    np.testing.assert_allclose(report.skewness.numpy(), (centred**3).mean(0) / variance**1.5, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(report.kurtosis.numpy(), (centred**4).mean(0) / variance**2 - 3, rtol=1e-9)
    np.testing.assert_array_equal(report.density.numpy(), (x != 0).mean(0))
    np.testing.assert_array_equal(report.max.numpy(), x.max(0).astype(np.float32))
    np.testing.assert_array_equal(report.min.numpy(), x.min(0).astype(np.float32))
    assert report.count.tolist() == [ids.numel()] * 6


def test_special_ids_and_excluded_positions_are_left_out_of_everything(planted):
    model, ids, table = planted

    class Tokenizer:
        bos_token_id, eos_token_id, pad_token_id = 7, None, 3

        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    report = feature_statistics(
        model, ids, _units(), tokenizer=Tokenizer(), k=50, exclude=[0, -1], bands=2, min_gap=0, progress=False
    )
    included = ~torch.isin(ids, torch.tensor([7, 3]))
    included[:, [0, -1]] = False
    assert report.count.tolist() == [int(included.sum())] * 6
    expected = brute_top(_acts(table, ids), included, 50, 0)
    for u in range(6):
        assert [(e.value, e.document, e.position) for e in report.top(u)] == expected[u]
        for e in report.top(u) + report.non_activating(u) + [x for band in report.bands(u) for x in band]:
            assert bool(included[e.document, e.position])
    assert report.text([1, 2]) == "<1><2>"


def test_dead_units_and_density(planted):
    model, ids, _table = planted
    report = feature_statistics(model, ids, _units(), k=2, bands=0, progress=False)
    assert report.dead == [4]
    assert report.top(4)[0].value == 0.0  # a dead unit still has its (zero) top examples


@pytest.mark.parametrize("kind", ["interval", "rank"])
def test_bands_hold_only_activating_values_inside_their_edges(planted, kind):
    model, ids, table = planted
    report = feature_statistics(model, ids, _units(), k=2, bands=4, samples=3, progress=False)
    x = _acts(table, ids)
    for u in range(6):
        edges = report.band_edges(u, kind)
        assert len(edges) == 5 and edges == sorted(edges)
        bands = report.bands(u, kind)
        assert len(bands) == 4
        for j, band in enumerate(bands):
            members = int(((x[..., u] > edges[j]) & (x[..., u] <= edges[j + 1]) & (x[..., u] > 0)).sum())
            assert len(band) == min(3, members), (u, j)
            for e in band:
                assert e.value > 0 and edges[j] < e.value <= edges[j + 1]
                assert e.value == float(x[e.document, e.position, u])
    assert report.band_edges(0, "interval") == [float(report.max[0]) * j / 4 for j in range(5)]
    assert all(not band for band in report.bands(4, kind))  # the dead unit has none


def test_band_and_non_activating_samples_are_the_smallest_keys_of_their_members(planted):
    """The samples are exactly bottom-k by the documented keys: what any split of the data reproduces."""
    model, ids, table = planted
    report = feature_statistics(model, ids, _units(), k=2, bands=3, samples=4, seed=5, progress=False)
    x = _acts(table, ids)
    docs, tokens = ids.shape
    for u in range(6):
        keys = _math.keys(5, torch.tensor([u]), torch.arange(docs), torch.arange(tokens))[0]
        quiet = [(int(keys[d, t]), d, t) for d in range(docs) for t in range(tokens) if x[d, t, u] <= 0]
        assert [(e.document, e.position) for e in report.non_activating(u)] == [(d, t) for _, d, t in sorted(quiet)[:4]]
        band_keys = _math.keys(6, torch.tensor([u]), torch.arange(docs), torch.arange(tokens))[0]
        edges = report.band_edges(u)
        for j, band in enumerate(report.bands(u)):
            members = [
                (int(band_keys[d, t]), d, t)
                for d in range(docs)
                for t in range(tokens)
                if edges[j] < float(x[d, t, u]) <= edges[j + 1] and x[d, t, u] > 0
            ]
            assert [(e.document, e.position) for e in band] == [(d, t) for _, d, t in sorted(members)[:4]]


def test_bottom_k_by_key_is_a_uniform_sample_chi_square():
    """Over 3,000 seeds, each of 20 members is drawn by bottom-5 keys equally often (chi-square, 19 dof)."""
    counts = torch.zeros(20)
    for seed in range(3000):
        keys = _math.keys(seed, torch.tensor([3]), torch.tensor([2]), torch.arange(20))[0, 0]
        counts[keys.argsort()[:5]] += 1
    expected = 3000 * 5 / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # the 0.999 quantile of chi-square with 19 degrees of freedom


def test_logit_effects_and_neighbours_are_absent_where_unknown_and_say_so(planted):
    model, ids, _ = planted
    report = feature_statistics(model, ids, _units(), k=2, bands=0, progress=False)
    with pytest.raises(ValueError, match="no logit effects"):
        report.logit_effects(0)
    with pytest.raises(ValueError, match="coactivation=True"):
        report.neighbours(0)
    assert report.neighbours(0, 2, by="cosine") == [(1, 0.0), (2, 0.0)]  # orthogonal directions, ties by number


def test_correlation_neighbours_equal_numpy_over_the_whole_dataset(planted):
    model, ids, table = planted
    vectors = torch.eye(6)
    vectors[3] = vectors[1] * 2  # unit 3 is twice unit 1: correlation 1
    report = feature_statistics(model, ids, Directions(vectors, "embed"), k=2, bands=0, coactivation=True,
                                batch_size=3, progress=False)  # fmt: skip
    x = (table[ids].reshape(-1, 6) @ vectors.T).double().numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = np.corrcoef(x.T)
    first = report.neighbours(1, 5)
    assert first[0][0] == 3 and first[0][1] == pytest.approx(1.0, abs=1e-12)
    for j, r in report.neighbours(0, 5):
        assert r == pytest.approx(expected[0, j], abs=1e-9)
    assert all(j != 4 for j, _ in report.neighbours(0, 5))  # the dead unit has no correlation


def test_quantiles_within_the_stated_value_and_rank_error():
    """The sketch on 10^6 values of both signs and a point mass at 0: each answer within 2% of a value whose rank
    is off by at most the stated bound."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(400_000, generator=gen).exp(), -torch.rand(300_000, generator=gen) * 50,
                   torch.zeros(300_000)])  # fmt: skip
    counts = torch.bincount(_math.bucket(x), minlength=_math.BUCKETS)[None]
    qs = torch.tensor([0.0, 0.01, 0.1, 0.25, 0.3, 0.5, 0.65, 0.9, 0.99, 1.0], dtype=torch.float64)
    got = _math.sketch_quantile(counts, qs)[0]
    bound = float(_math.rank_error(counts)[0])
    assert bound < 0.015  # the buckets are 4% wide: about 1% of a smooth distribution in the fullest one
    ordered = np.sort(x.double().numpy())
    n = len(ordered)
    for q, v in zip(qs.tolist(), got.tolist(), strict=True):
        exact = ordered[max(math.ceil(q * n), 1) - 1]
        assert v == pytest.approx(exact, rel=_math.ALPHA * 1.0001, abs=1e-12)
        below, at_most = np.searchsorted(ordered, v, "left") / n, np.searchsorted(ordered, v, "right") / n
        assert below - bound <= q <= at_most + bound


@pytest.mark.slow
def test_quantile_rank_error_on_ten_million_values():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000_000, generator=gen) * 3
    counts = torch.bincount(_math.bucket(x), minlength=_math.BUCKETS)[None]
    qs = torch.linspace(0, 1, 41, dtype=torch.float64)
    got = _math.sketch_quantile(counts, qs)[0].numpy()
    bound = float(_math.rank_error(counts)[0])
    ordered = np.sort(x.numpy().astype(np.float64))
    n = len(ordered)
    below, at_most = np.searchsorted(ordered, got, "left") / n, np.searchsorted(ordered, got, "right") / n
    assert np.all((below - bound <= qs.numpy()) & (qs.numpy() <= at_most + bound))
    assert bound < 0.012


def test_histogram_counts_every_non_zero_value_once(planted):
    model, ids, table = planted
    report = feature_statistics(model, ids, _units(), k=2, bands=0, progress=False)
    x = _acts(table, ids)
    for u in range(6):
        edges, counts = report.histogram(u, bins=7)
        assert int(counts.sum()) == int((x[..., u] != 0).sum())
        assert len(edges) == 8


def test_save_and_load_give_the_same_report_and_a_damaged_file_is_refused(planted, tmp_path):
    model, ids, _ = planted
    report = feature_statistics(model, ids, _units(), k=3, bands=2, progress=False)
    path = report.save(tmp_path / "r.report")
    again = UnitReport.load(path)
    assert_same(report, again)
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        UnitReport.load(path)
    (tmp_path / "other").write_text("{}\n")
    with pytest.raises(ValueError, match="not a UnitReport"):
        UnitReport.load(tmp_path / "other")


def assert_same(a: UnitReport, b: UnitReport) -> None:
    """Two reports are equal bit for bit (every tensor, list and number of their state)."""

    def same(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, where
            assert torch.equal(x.nan_to_num(1234.5), y.nan_to_num(1234.5)), where
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), where
            for key in x:
                same(x[key], y[key], f"{where}.{key}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for i, (p, q) in enumerate(zip(x, y, strict=True)):
                same(p, q, f"{where}[{i}]")
        else:
            assert x == y, where

    same(a.state(), b.state(), "report")


def test_quantiles_of_four_values_by_hand():
    """The q-quantile is the value of rank ceil(q n) (at least 1): of 1, 2, 3, 4, q = 0.3 gives 2, q = 0.25 gives 1."""
    counts = torch.bincount(_math.bucket(torch.tensor([4.0, 1.0, 3.0, 2.0])), minlength=_math.BUCKETS)[None]
    got = _math.sketch_quantile(counts, torch.tensor([0.0, 0.25, 0.3, 0.5, 0.51, 1.0], dtype=torch.float64))[0]
    assert got.tolist() == pytest.approx([1.0, 1.0, 2.0, 2.0, 3.0, 4.0], rel=_math.ALPHA * 1.0001)
