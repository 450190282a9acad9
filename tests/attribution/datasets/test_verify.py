"""Stored files are verified: damaged shards and metadata are named, and a re-run repairs exactly them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset, open_results

ITEMS = 11  # shards of 4: 4, 4, 3


class Counting:
    """A CAM that counts the items it computes."""

    def __init__(self, cam: GradCAM) -> None:
        self.cam, self.model, self.items = cam, cam.model, 0

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        self.items += len(inputs)
        return self.cam(inputs, target)

    def __repr__(self) -> str:
        return repr(self.cam)


@pytest.fixture
def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, 3, 8, 8, generator=g))


@pytest.fixture
def cam(tiny_cnn) -> GradCAM:
    return GradCAM(tiny_cnn, "features.2")


@pytest.fixture
def out(cam, data, tmp_path) -> Path:
    attribute_dataset(cam, data, tmp_path, batch_size=2, shard_size=4, progress=False)
    return tmp_path


def stamps(out: Path, shards: list[str]) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file of ``shards``."""
    return {
        str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for s in shards for p in sorted((out / "shards" / s).iterdir())
    }


def rerun(cam: GradCAM, data: TensorDataset, out: Path, damaged: str | None) -> Counting:
    """Run again with the same arguments; it warns naming the damaged shard (if any)."""
    counting = Counting(cam)
    if damaged is None:
        attribute_dataset(counting, data, out, batch_size=2, progress=False)
    else:
        with pytest.warns(UserWarning, match=f"damaged .*shards/{damaged}"):
            attribute_dataset(counting, data, out, batch_size=2, progress=False)
    return counting


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # a bit of the last map's values, after the header
    path.write_bytes(bytes(raw))


def break_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[10:20] = b"garbage!!!"  # same size, unreadable header
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [truncate, break_header, lambda p: p.write_bytes(b"")])
def test_a_damaged_shard_is_named_and_exactly_it_is_recomputed(damage, cam, data, out):
    maps = open_results(out).maps[:]
    others = stamps(out, ["000000", "000002"])
    damage(out / "shards/000001/maps.npy")
    with pytest.raises(ValueError, match=r"shards/000001/maps\.npy .*again with the same arguments"):
        open_results(out)
    counting = rerun(cam, data, out, "000001")
    assert counting.items == 4  # that shard only
    assert stamps(out, ["000000", "000002"]) == others  # the others are not rewritten
    assert torch.equal(open_results(out, verify=True).maps[:], maps)


def test_a_bit_flip_is_caught_by_a_full_check_and_by_a_resume(cam, data, out):
    maps = open_results(out).maps[:]
    flip(out / "shards/000002/maps.npy")
    open_results(out)  # the cheap check (sizes, headers) does not read the values
    with pytest.raises(ValueError, match=r"shards/000002/maps\.npy does not match its checksum"):
        open_results(out, verify=True)
    assert rerun(cam, data, out, "000002").items == 3
    assert torch.equal(open_results(out, verify=True).maps[:], maps)


def test_an_empty_meta_json_is_named_and_its_shard_recomputed(cam, data, out):
    (out / "shards/000000/meta.json").write_text("")
    with pytest.raises(ValueError, match=r"shards/000000/meta\.json has 0 bytes"):
        open_results(out)
    assert rerun(cam, data, out, "000000").items == 4
    open_results(out, verify=True)


def test_an_empty_or_damaged_manifest_is_rebuilt_without_computing(cam, data, out):
    maps = open_results(out).maps[:]
    for text in ("", '{"format": "hookscope-attri'):
        (out / "manifest.json").write_text(text)
        with pytest.raises(ValueError, match=r"manifest\.json is damaged .*again with the same arguments"):
            open_results(out)
        assert rerun(cam, data, out, None).items == 0
        assert torch.equal(open_results(out, verify=True).maps[:], maps)


def test_an_empty_settings_json_is_rebuilt_from_a_copy_or_refused(cam, data, out):
    (out / "settings.json").write_text("")
    with pytest.warns(UserWarning, match=r"settings\.json was empty or damaged; written again from a copy"):
        attribute_dataset(cam, data, out, batch_size=2, progress=False)
    with pytest.raises(ValueError, match="other settings"):  # the rebuilt settings still guard the run
        attribute_dataset(cam, data, out, batch_size=2, dtype=torch.float16, progress=False)
    (out / "settings.json").write_text("")
    os.remove(out / "manifest.json")
    for meta in (out / "shards").glob("*/meta.json"):
        meta.write_text("")
    with pytest.raises(ValueError, match=r"settings\.json is empty or damaged .*overwrite=True"):
        attribute_dataset(cam, data, out, batch_size=2, progress=False)
