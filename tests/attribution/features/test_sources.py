"""Stores of documents as ``tokens``: a memory-mapped array and a store of dicts (as HF datasets), read in slices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attribution.features import Directions, feature_statistics

from .test_statistics import assert_same


class DictStore:
    """An HF-dataset-like store: ``store[i:j]`` gives ``{"input_ids": rows, "attention_mask": ...}`` as lists."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.sliced: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key: slice) -> dict[str, list[list[int]]]:
        self.sliced.append((key.start, key.stop))
        rows = self.ids[key]
        return {"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist(), "text": ["x"] * len(rows)}


def _settings():
    return {"k": 2, "bands": 2, "batch_size": 4, "progress": False}


def _same_but_the_data(want, got, data: str) -> None:
    """The same report bit for bit; only the data's description differs (a store is checked as it is read)."""
    assert got.settings["data"] == data
    got.settings["data"] = want.settings["data"]
    assert_same(want, got)


def test_a_memory_mapped_array_gives_the_tensors_report(planted, tmp_path):
    model, ids, _ = planted
    units = Directions(torch.eye(6), "embed")
    stored = np.lib.format.open_memmap(tmp_path / "ids.npy", mode="w+", dtype=np.int32, shape=tuple(ids.shape))
    stored[:] = ids.numpy()
    stored.flush()
    rows = np.load(tmp_path / "ids.npy", mmap_mode="r")
    want = feature_statistics(model, ids, units, **_settings())
    got = feature_statistics(model, rows, units, **_settings())
    _same_but_the_data(want, got, "memmap of 23 documents (checked as read)")


def test_a_store_of_dicts_is_read_in_slices_of_batch_size_with_its_mask(planted):
    model, ids, _ = planted
    units = Directions(torch.eye(6), "embed")
    store = DictStore(ids)
    got = feature_statistics(model, store, units, **_settings())
    _same_but_the_data(
        feature_statistics(model, ids, units, **_settings()), got, "DictStore of 23 documents (checked as read)"
    )
    assert store.sliced[:6] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]


def test_an_empty_store_and_float_rows_are_refused(planted):
    model, ids, _ = planted
    units = Directions(torch.eye(6), "embed")
    with pytest.raises(ValueError, match="no documents"):
        feature_statistics(model, np.zeros((0, 5), dtype=np.int64), units, progress=False)
    with pytest.raises(TypeError, match="integer token ids"):
        feature_statistics(model, ids.numpy().astype(np.float32), units, progress=False)
