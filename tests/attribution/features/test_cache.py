"""``cache=``: the second pass reads the first pass's site tensors from disk, to the same report, bit for bit."""

from __future__ import annotations

import pytest

from attribution.features import statistics as stats_module
from attribution.features._cache import SiteCache

from .test_resume import Batches, Killed, _run
from .test_statistics import assert_same


@pytest.fixture
def forwards(monkeypatch):
    """The forwards the pass runs (each batch's sites read from the model)."""
    ran: list[int] = []
    original = stats_module._site_tensors
    monkeypatch.setattr(stats_module, "_site_tensors", lambda *a: ran.append(1) or original(*a))
    return ran


def test_the_second_pass_reads_the_cache_and_gives_the_same_report(planted, tmp_path, forwards):
    model, ids, _ = planted
    whole = _run(model, ids, None, batch_size=3)
    assert len(forwards) == 16  # 8 batches, two passes
    cached = _run(model, ids, None, batch_size=3, cache=tmp_path / "sites")
    assert_same(whole, cached)
    assert len(forwards) == 16 + 8  # the second pass ran no forward
    assert list((tmp_path / "sites").iterdir()) == []  # the files are removed at the end


def test_without_bands_nothing_is_written(planted, tmp_path, forwards):
    model, ids, _ = planted
    _run(model, ids, None, batch_size=3, bands=0, cache=tmp_path / "sites")
    assert not (tmp_path / "sites").exists() or list((tmp_path / "sites").iterdir()) == []


def test_files_of_other_ids_or_damaged_ones_are_run_again(planted, tmp_path, forwards):
    model, ids, _ = planted
    whole = _run(model, ids, None, batch_size=3)
    folder = tmp_path / "sites"
    original = SiteCache.write

    def spoil(self, index, batch_ids, sites):
        original(self, index, batch_ids, sites)
        path = self._path(index)
        if index == 1:  # another batch's ids under this index
            original(self, index, batch_ids + 1, sites)
        elif index == 2:  # a damaged file
            path.write_bytes(path.read_bytes()[:-10])
        elif index == 3:  # a file of another run (another tag) beside it: neither read nor removed
            original(SiteCache(folder, {"another": "run"}, 0), index, batch_ids, sites)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SiteCache, "write", spoil)
        cached = _run(model, ids, None, batch_size=3, cache=folder)
    assert_same(whole, cached)
    assert len(forwards) == 16 + 8 + 2  # batches 1 and 2 ran again in the second pass
    left = sorted(p.name for p in folder.iterdir())
    assert len(left) == 3 and all(name.startswith("sites-") for name in left)  # only the files it did not use


def test_a_run_killed_in_the_second_pass_resumes_from_the_cache(planted, tmp_path, forwards):
    model, ids, _ = planted
    whole = _run(model, Batches(ids, 2), None)
    path, folder = tmp_path / "run.ckpt", tmp_path / "sites"
    with pytest.raises(Killed):
        _run(model, Batches(ids, 2, 17), path, cache=folder)  # 12 batches a pass: killed in the second
    before = len(forwards)
    assert_same(whole, _run(model, Batches(ids, 2), path, cache=folder))
    assert len(forwards) == before  # the rest of the second pass came from the cache
