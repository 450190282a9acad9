"""One writer per folder: a second run is refused naming the holder; leftovers removed; read-only folders opened."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset, open_results
from attribution.datasets import _lock
from tests.attribution.datasets import _worker as worker
from tests.attribution.datasets.test_processes import ROOT, WORKER, environment

ITEMS = 8


@pytest.fixture
def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, 3, 8, 8, generator=g))


class Waiting:
    """A CAM that waits for ``go`` before its first batch (so that a run holds its folder for as long as needed)."""

    def __init__(self, cam: GradCAM) -> None:
        self.cam, self.model = cam, cam.model
        self.started, self.go = threading.Event(), threading.Event()

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        self.started.set()
        assert self.go.wait(30)
        return self.cam(inputs, target)

    def __repr__(self) -> str:
        return repr(self.cam)


def snapshot(out: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of everything in ``out``."""
    return {str(p): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))}


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    first = Waiting(cam)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            attribute_dataset(first, data, tmp_path, batch_size=2, progress=False)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert first.started.wait(30)
        holder = re.escape(f"in use by another run (process {os.getpid()} on")
        for dtype in (torch.float32, torch.float16):  # same settings or not: the folder is taken
            with pytest.raises(_lock.InUseError, match=re.escape(repr(str(tmp_path))) + ".* " + holder):
                attribute_dataset(cam, data, tmp_path, batch_size=2, dtype=dtype, progress=False)
    finally:
        first.go.set()
        thread.join(60)
    assert not errors
    assert torch.equal(open_results(tmp_path).maps[:], cam(data.tensors[0]))  # the first run completed, correct
    attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)  # released at its end


def test_leftovers_of_killed_runs_are_removed_once_the_folder_is_held(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)
    (tmp_path / "settings.json.tmp-otherhost-12").write_text("{")
    (tmp_path / "shards" / "000003.tmp-otherhost-12").mkdir()
    attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)
    assert not list(tmp_path.glob("*.tmp-*")) and not list((tmp_path / "shards").glob("*.tmp-*"))


def test_a_finished_run_opened_again_writes_nothing(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)
    before = snapshot(tmp_path)
    attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)
    after = snapshot(tmp_path)
    lock = str(tmp_path / _lock.LOCK)
    assert after.pop(lock)[0] == before.pop(lock)[0]  # the lock file names its last holder; nothing else changes
    assert after == before


def test_a_read_only_folder_returns_a_finished_run_and_refuses_the_rest(tiny_cnn, data, tmp_path, monkeypatch):
    cam = GradCAM(tiny_cnn, "features.2")
    attribute_dataset(cam, data, tmp_path / "done", batch_size=2, progress=False)
    stopped = Waiting(cam)
    stopped.go.wait = lambda timeout: (_ for _ in ()).throw(KeyboardInterrupt)  # Ctrl-C in the first batch
    with pytest.raises(KeyboardInterrupt):
        attribute_dataset(stopped, data, tmp_path / "half", batch_size=2, progress=False)
    before = snapshot(tmp_path)
    opened = os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:  # as on a read-only mount (root ignores chmod)
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return opened(path, flags, *args)

    monkeypatch.setattr(_lock.os, "open", read_only)
    res = attribute_dataset(cam, data, tmp_path / "done", batch_size=2, progress=False)
    assert torch.equal(res.maps[:], cam(data.tensors[0]))
    with pytest.raises(PermissionError, match=r"cannot be written \(read-only\).*other settings"):
        attribute_dataset(cam, data, tmp_path / "done", batch_size=2, dtype=torch.float16, progress=False)
    with pytest.raises(PermissionError, match=r"cannot be written \(read-only\).*not finished"):
        attribute_dataset(cam, data, tmp_path / "half", batch_size=2, progress=False)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_second_process_is_refused_and_a_killed_holder_releases_the_folder(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, str(WORKER), str(out), "4", "1.5"]  # 6 batches of 1.5 s: outlives a start
    first = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while f"process {first.pid} " not in ((out / _lock.LOCK).read_text() if (out / _lock.LOCK).exists() else ""):
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read().decode()[-3000:]
            time.sleep(0.02)
        second = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and f"in use by another run (process {first.pid} on" in second.stderr
        assert first.poll() is None  # refused while the first one still runs
        first.kill()  # SIGKILL: the kernel releases the lock
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        first.stderr.close()
    worker.run(out, shard_size=4)  # takes the folder, resumes, finishes
    assert torch.equal(open_results(out).index[:], torch.arange(worker.ITEMS))
