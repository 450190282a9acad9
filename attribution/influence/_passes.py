"""Passes over a training source: this process's share of the batches, sums over all processes, checkpoints.

A fit's pass (the diagonal Fisher, the K-FAC factors, the EK-FAC eigenvalues) sums per-batch tensors. Under
``torchrun`` every process reads the whole source and computes the batches ``i`` with ``i % world == rank``; the
sums are then added over the processes, so one process and several give the same factors (up to the order of the
additions). The labels a sampled Fisher draws come from a generator seeded per batch (the seed, the pass, the
batch's index), which is what makes the processes' draws those of one process. Every batch is fingerprinted
(:func:`batch_digest`): a checkpoint resumes only on the same source, and scores refuse a source whose items
changed since the fit.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import _distributed as dist
from .._progress import progress
from ._batches import batches

BatchSums = Callable[[Any, torch.Generator], dict[str, Tensor]]


def batch_digest(batch: Any) -> str:
    """A digest of every tensor of a batch (dtype, shape, values), in its order (a mapping: by key)."""
    h = hashlib.sha256()
    items = sorted(batch.items()) if isinstance(batch, dict) else enumerate(batch)
    for key, value in items:
        h.update(f"{key};".encode())
        for tensor in value.values() if isinstance(value, dict) else [value]:
            if isinstance(tensor, Tensor):
                h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def batch_seed(seed: int, stage: int, index: int) -> int:
    """The seed of the labels drawn for batch ``index`` of pass ``stage``: the same in every process."""
    return (seed * 1_000 + stage) * 1_000_003 + index


class Checkpoint:
    """A fit's checkpoint file (one per process under torchrun): finished passes and the running one's sums.

    Written atomically (a temporary file, then a rename) at most every ``every`` seconds and at the end of each
    pass; read back only when the fit's settings (method, damping, Fisher, seed, modules, the model's digest and
    the number of processes) are those it was written with.
    """

    def __init__(self, path: str | Path, settings: dict[str, Any], every: float) -> None:
        rank, world = dist.setup()
        target = Path(path)
        self.path = target if world == 1 else target.with_name(f"{target.name}.rank{rank}")
        self.settings, self.every, self.last = {**settings, "processes": world}, every, time.monotonic()

    def load(self) -> dict[str, Any]:
        """What was saved (``{"finished": {...}, "running": {...} or None}``), or an empty start."""
        if not self.path.exists():
            return {"finished": {}, "running": None}
        saved = torch.load(self.path, weights_only=True)
        if saved.get("settings") != self.settings:
            differ = sorted(k for k in self.settings if saved.get("settings", {}).get(k) != self.settings[k])
            raise ValueError(
                f"the checkpoint {self.path} was written by another fit (its {', '.join(differ)} differ): delete it, "
                "or fit with the model, settings and number of processes it was written with"
            )
        return saved

    def save(self, content: dict[str, Any], force: bool = False) -> None:
        """Write ``content`` if ``every`` seconds have passed since the last write (or ``force``)."""
        if not force and time.monotonic() - self.last < self.every:
            return
        partial = self.path.with_name(self.path.name + ".partial")
        torch.save({"settings": self.settings, **content}, partial)
        partial.replace(self.path)
        self.last = time.monotonic()


def accumulate(
    data: Any,
    stage: int,
    per_batch: BatchSums,
    *,
    seed: int,
    what: str,
    show: bool,
    checkpoint: Checkpoint | None = None,
    saved: dict[str, Any] | None = None,
) -> tuple[dict[str, Tensor], list[str]]:
    """The sums of ``per_batch`` over all batches of ``data`` (all processes added) and every batch's digest.

    ``saved``: the checkpoint's content; its running pass, if it is this one, is resumed after checking that the
    batches it covered are the same ones. The checkpoint is written as the pass goes.
    """
    rank, world = dist.setup()
    running = (saved or {}).get("running")
    start = running if running is not None and running["stage"] == stage else None
    sums: dict[str, Tensor] = dict(start["sums"]) if start else {}
    digests: list[str] = []
    for index, batch in _numbered(data, what, show):
        digests.append(batch_digest(batch))
        if start is not None and index < start["next"]:
            _check_same(digests, start["digests"], index, checkpoint)
            continue
        if index % world == rank:
            for key, value in per_batch(batch, torch.Generator().manual_seed(batch_seed(seed, stage, index))).items():
                sums[key] = sums[key] + value if key in sums else value
        if checkpoint is not None:
            running = {"stage": stage, "next": index + 1, "sums": sums, "digests": digests}
            checkpoint.save({"finished": (saved or {}).get("finished", {}), "running": running})
    if start is not None and len(digests) < start["next"]:
        raise ValueError(
            f"the training source gave {len(digests)} batches, fewer than the {start['next']} the checkpoint covered: "
            "resume with the source the fit started on"
        )
    _check_every_process_had_a_batch(len(digests), world)
    return {key: dist.all_sum(sums[key]) for key in sorted(sums)}, digests


def _numbered(data: Any, what: str, show: bool) -> Iterator[tuple[int, Any]]:
    return enumerate(progress(batches(data), desc=what, enabled=show, unit="batch"))


def _check_same(digests: list[str], saved: list[str], index: int, checkpoint: Checkpoint | None) -> None:
    if digests[index] != saved[index]:
        where = checkpoint.path if checkpoint is not None else "the checkpoint"
        raise ValueError(
            f"batch {index} of the training source differs from the one {where} was written on (a shuffled "
            "DataLoader, random augmentation, or other data): resume with the same batches in the same order, or "
            "delete the checkpoint"
        )


def _check_every_process_had_a_batch(count: int, world: int) -> None:
    if count < world:
        raise ValueError(
            f"the training source has {count} batches for {world} processes: every process needs at least one; use "
            "smaller batches or fewer processes"
        )


def check_digests(digests: list[str], fitted: list[str], index: int) -> None:
    """Refuse the fitted source when its batch ``index`` is not the one the fit read."""
    if index >= len(fitted) or digests[index] != fitted[index]:
        raise ValueError(
            f"the training source changed since .fit: its batch {index} is not the one the fit read (a shuffled "
            "DataLoader or random augmentation gives other items, so score columns would not be the fitted "
            "examples). Pass a source that yields the same batches in the same order (shuffle=False), or fit again"
        )
