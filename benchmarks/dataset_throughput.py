"""attribute_dataset: scaling over processes, overhead over a plain loop, memory over 10,000 images.

Run from the repository root: python -m benchmarks.dataset_throughput [--rounds 3] [--items 512] [--rss-items 10000]

1. Scaling: Grad-CAM (resnet18, random weights, 10 classes, layer4) over ``--items`` synthetic 64x64 images, batch
   16, maps stored float32: ``torchrun --standalone --nproc_per_node=P`` with P = 1 and 2, one thread per process
   (``OMP_NUM_THREADS=1``). Timed inside the processes, from a barrier after start-up and a warm-up batch to the
   end of ``attribute_dataset`` (which ends when every shard and the manifest are written); process start-up (about
   2-5 s: importing torch and the library) is not counted. Target: 2 processes >= 1.7x the items/s of one.
2. Overhead: the same workload in this process (one thread): ``attribute_dataset`` against a plain loop over a
   ``DataLoader`` that calls the method batch by batch and keeps nothing. Target: <= 5% more time.
3. Memory: a small CNN over ``--rss-items`` 3x64x64 images (maps 64x64 float32: 16 KiB per image, 160 MB for
   10,000, so a runner that kept them would show it), RSS sampled every 10 batches after the first 10. Target:
   growth < 50 MB. For contrast, a plain loop that collects the maps in a list.

The variants run interleaved, round after round; medians are reported (for the overhead also the minimum, the
least disturbed round), with the load average of the machine (other jobs share the 2 cores: a load above 2 during
a run makes the scaling number meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset

from attribution import GradCAM, attribute_dataset
from benchmarks._timing import setup, table

ROOT = Path(__file__).resolve().parents[1]
BATCH = 16


class Synthetic(Dataset[torch.Tensor]):
    """``items`` images that cost nothing to load: 64 fixed random images, repeated."""

    def __init__(self, items: int, size: int = 64) -> None:
        self.items = items
        self.base = torch.randn(64, 3, size, size, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.base[index % len(self.base)]


def resnet_cam() -> GradCAM:
    torch.manual_seed(0)
    return GradCAM(torchvision.models.resnet18(num_classes=10).eval(), "layer4")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def rss_mb() -> float:
    """Resident set size of this process, MB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# -- 1. scaling ---------------------------------------------------------------------------------------------------
def child(out: Path, result: Path, items: int) -> None:
    """One torchrun process: warm up, wait for the others, time the run; each rank writes its wall and CPU time."""
    torch.set_num_threads(1)
    cam = resnet_cam()
    data = Synthetic(items)
    cam(torch.stack([data[i] for i in range(BATCH)]))  # warm-up (first-call allocations)
    rank = 0
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    attribute_dataset(cam, data, out, batch_size=BATCH, progress=False)
    times = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    result.with_name(f"{result.stem}-{rank}.json").write_text(json.dumps(times))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(processes: int, items: int) -> tuple[float, list[float]]:
    """Start ``processes`` workers with torchrun: rank 0's wall seconds, and every rank's CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command += ["-m", "benchmarks.dataset_throughput", "--child", str(Path(tmp) / "out"), str(result)]
        command += ["--items", str(items)]
        subprocess.run(command, check=True, cwd=ROOT, env=env, capture_output=True)
        ranks = [json.loads((Path(tmp) / f"result-{r}.json").read_text()) for r in range(processes)]
        return ranks[0]["wall"], [r["cpu"] for r in ranks]


def scaling(rounds: int, items: int) -> None:
    wall: dict[int, list[float]] = {1: [], 2: []}
    busiest: dict[int, list[float]] = {1: [], 2: []}  # CPU seconds of the process with the most work
    loads = [load()]
    for _ in range(rounds):
        for processes in (1, 2):
            seconds, cpu = launch(processes, items)
            wall[processes].append(seconds)
            busiest[processes].append(max(cpu))
        loads.append(load())
    median = {p: statistics.median(t) for p, t in wall.items()}
    cpu = {p: statistics.median(t) for p, t in busiest.items()}
    rows = [
        [
            f"{p} x 1 thread",
            f"{median[p]:.2f}",
            " ".join(f"{t:.2f}" for t in wall[p]),
            f"{items / median[p]:.1f}",
            f"{cpu[p]:.2f}",
        ]
        for p in (1, 2)
    ]
    print(f"1. scaling: Grad-CAM resnet18 layer4, {items} images 64x64, batch {BATCH}; median of {rounds} rounds")
    print(table(["processes", "wall s", "wall s (each round)", "items/s", "CPU s of the busiest process"], rows))
    print(f"speed-up 2 vs 1 process, wall time: {median[1] / median[2]:.2f}x (target >= 1.7x)")
    print(f"CPU time of one process / of the busiest of two: {cpu[1] / cpu[2]:.2f}x (the speed-up on idle cores)")
    print(f"load average during: {loads}")
    print()


# -- 2. overhead --------------------------------------------------------------------------------------------------
def overhead(rounds: int, items: int) -> None:
    setup(1)
    cam = resnet_cam()
    data = Synthetic(items)
    folder = Path(tempfile.mkdtemp())
    runs = iter(range(10**6))

    def plain() -> None:
        for x in DataLoader(data, batch_size=BATCH):
            cam(x)

    def runner() -> None:
        attribute_dataset(cam, data, folder / str(next(runs)), batch_size=BATCH, progress=False)

    variants = {"plain loop": plain, "attribute_dataset": runner}
    before = load()
    plain()  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    rows = []
    for statistic in (statistics.median, min):
        w = {name: statistic(t) for name, t in wall.items()}
        c = {name: statistic(t) for name, t in cpu.items()}
        rows += [
            [
                f"{name} ({statistic.__name__})",
                f"{w[name]:.3f}",
                f"{w[name] / w['plain loop']:.3f}",
                f"{c[name]:.3f}",
                f"{c[name] / c['plain loop']:.3f}",
            ]
            for name in variants
        ]
    print(f"2. overhead: same workload, {items} images, one process, 1 thread; {rounds} rounds (interleaved)")
    print(table(["variant", "wall s", "x plain", "CPU s", "x plain"], rows))
    print("each round (wall s):", {name: [round(t, 2) for t in times] for name, times in wall.items()})
    print(f"load average before: {before}, after: {load()}")
    print()


# -- 3. memory ----------------------------------------------------------------------------------------------------
class Sampled:
    """Wraps a method and samples the RSS every 10 batches, from the 10th on."""

    def __init__(self, method: Callable[..., torch.Tensor]) -> None:
        self.method, self.model, self.calls, self.samples = method, getattr(method, "model", None), 0, []

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 10 and self.calls % 10 == 0:
            self.samples.append(rss_mb())
        return self.method(inputs, target)


def memory(items: int) -> None:
    setup(1)
    torch.manual_seed(0)
    cam = GradCAM(SmallCNN().eval(), "features.2")
    data = Synthetic(items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sampled = Sampled(cam)
        start = time.perf_counter()
        attribute_dataset(sampled, data, tmp, batch_size=32, progress=False)
        seconds = time.perf_counter() - start
        rows.append(["attribute_dataset (to disk)", *_growth(sampled.samples), f"{seconds:.1f}"])
    kept: list[torch.Tensor] = []
    sampled = Sampled(cam)
    start = time.perf_counter()
    for x in DataLoader(data, batch_size=32):
        kept.append(sampled(x))
    rows.append(
        ["plain loop keeping the maps in a list", *_growth(sampled.samples), f"{time.perf_counter() - start:.1f}"]
    )
    print(f"3. memory: small CNN, Grad-CAM, {items} images 3x64x64 (maps 64x64 float32), batch 32, 1 thread")
    header = ["variant", "RSS at batch 10 (MB)", "max", "last", "max - first", "trend (last - first fifth)", "s"]
    print(table(header, rows))
    print(f"load average: {load()}")


def _growth(samples: list[float]) -> list[str]:
    """First, max and last RSS; growth as max - first, and as the median of the last fifth - that of the first."""
    fifth = max(1, len(samples) // 5)
    trend = statistics.median(samples[-fifth:]) - statistics.median(samples[:fifth])
    first, top, last = samples[0], max(samples), samples[-1]
    return [f"{first:.0f}", f"{top:.0f}", f"{last:.0f}", f"{top - first:.1f}", f"{trend:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--rss-items", type=int, default=10_000)
    parser.add_argument("--only", choices=("scaling", "overhead", "memory"))
    parser.add_argument("--child", nargs=2, type=Path, metavar=("OUT", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.items)
        return
    print(f"load average at start: {load()} (2 cores)\n")
    if args.only in (None, "scaling"):
        scaling(args.rounds, args.items)
    if args.only in (None, "overhead"):
        overhead(args.rounds, args.items)
    if args.only in (None, "memory"):
        memory(args.rss_items)


if __name__ == "__main__":
    main()
