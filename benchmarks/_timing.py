"""Shared benchmark helpers: interleaved timing with medians, tensor-memory peaks, tables."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def setup(threads: int = 2) -> None:
    """Fix the thread count and the seed, as the issues' numbers assume."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def interleaved(
    variants: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    statistic: Callable[[list[float]], float] = statistics.median,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median (or ``statistic``) time of each variant; the variants run in turn so that drift hits all alike.

    Round ``r`` starts with variant ``r`` (modulo their number), so that no variant always runs first, after the
    last one of the previous round. ``clock`` is wall time by default; ``time.process_time`` gives the CPU time of
    the process, which other jobs on a busy machine disturb less (with one torch thread, it is the work done).
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = variants[name]
            gc.collect()
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistic(values) for name, values in times.items()}


class TensorMemory(TorchDispatchMode):
    """Live bytes of tensor storages created inside the mode (forward and backward), with their peak.

    Storages that existed before (parameters, inputs) are not counted: what is measured is the memory a call
    adds. A storage counts until PyTorch frees it (checked through a weak reference before every operation).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def sweep(self) -> None:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.sweep()
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def memory(fn: Callable[[], Any]) -> tuple[float, float]:
    """(peak MiB, MiB still held after the call while its result is alive) of the tensors ``fn()`` creates."""
    gc.collect()
    with TensorMemory() as tracker:
        result = fn()
    gc.collect()
    tracker.sweep()
    kept = tracker.current
    del result
    return tracker.peak / 2**20, kept / 2**20


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])
