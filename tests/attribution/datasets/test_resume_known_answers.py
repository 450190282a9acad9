"""Resuming ``attribute_dataset`` in a partly written folder: exactly the missing shards run, nothing else is touched.

The method records which dataset items it was called on and adds an offset to its maps, so that a shard computed
by the second run is told apart from one kept from the first.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from attribution import attribute_dataset, open_results

ITEMS, BATCH, SHARD = 11, 2, 4  # shards 0..2 of 4, 4 and 3 items: the last one is short


class Recording:
    """``maps = inputs + offset``; remembers the dataset items of every call (through the inputs' values)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset
        self.seen: list[int] = []

    def __call__(self, inputs: torch.Tensor, target: object) -> torch.Tensor:
        self.seen += inputs[:, 0, 0].long().tolist()
        return inputs + self.offset

    def __repr__(self) -> str:  # the same in both runs: the settings of the resumed run match
        return "Recording()"


@pytest.fixture
def data() -> torch.Tensor:
    return torch.arange(ITEMS, dtype=torch.float32)[:, None, None].expand(ITEMS, 2, 3).clone()


def run(method: Recording, data: torch.Tensor, out) -> object:
    return attribute_dataset(method, data, out, batch_size=BATCH, shard_size=SHARD, progress=False)


@pytest.mark.parametrize("missing", [[1], [0, 2], [2], [0, 1, 2]])
def test_only_the_missing_shards_run_again(tmp_path, data, missing):
    first = Recording(0.0)
    run(first, data, tmp_path)
    assert sorted(first.seen) == list(range(ITEMS))
    (tmp_path / "manifest.json").unlink()  # interrupted before the end
    for shard in missing:
        shutil.rmtree(tmp_path / "shards" / f"{shard:06d}")
    leftover = tmp_path / "shards" / f"{missing[0]:06d}.tmp-host-123"  # what an interrupted run was writing
    leftover.mkdir()

    second = Recording(100.0)
    results = run(second, data, tmp_path)
    redone = [i for shard in missing for i in range(shard * SHARD, min((shard + 1) * SHARD, ITEMS))]
    assert sorted(second.seen) == redone
    assert len(results) == ITEMS
    for i in range(ITEMS):
        offset = 100.0 if i in redone else 0.0
        torch.testing.assert_close(results.maps[i], data[i] + offset)
        assert results.index[i].item() == i
    assert not leftover.exists()  # removed when its shard is written again


def test_a_complete_folder_runs_nothing(tmp_path, data):
    run(Recording(0.0), data, tmp_path)
    again = Recording(100.0)
    results = run(again, data, tmp_path)
    assert again.seen == []
    torch.testing.assert_close(results.maps[:], data)


def test_an_unfinished_folder_says_how_many_shards_are_written(tmp_path, data):
    run(Recording(0.0), data, tmp_path)
    (tmp_path / "manifest.json").unlink()
    shutil.rmtree(tmp_path / "shards" / "000002")
    with pytest.raises(FileNotFoundError, match="2 of 3 shards written"):
        open_results(tmp_path)


def test_columns_read_across_shard_boundaries(tmp_path, data):
    results = run(Recording(0.5), data, tmp_path)
    picked = [10, 3, 4, 7, 8, 0]  # every shard, out of order, both sides of each boundary
    torch.testing.assert_close(results.maps[picked], data[picked] + 0.5)
    torch.testing.assert_close(results.maps[-1], data[10] + 0.5)
    torch.testing.assert_close(results.maps[3:9:2], data[3:9:2] + 0.5)
    assert [int(m[0, 0]) for m in results.maps] == list(range(ITEMS))
