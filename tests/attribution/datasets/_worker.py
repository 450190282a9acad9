"""One dataset run, the same in the test process and in the processes the tests start (torchrun, a killed run).

Usage: python _worker.py OUT SHARD_SIZE [DELAY] [-- COMMAND LINE ARGUMENTS]
(under torchrun or alone, with the repository on PYTHONPATH); after the run, ``python -m attribution.cli`` runs in the
same processes with the arguments after ``--``, which saves the tests a second start of torchrun.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset, class_means, mean_patching
from tests.support import TinyCNN

ITEMS = 11  # odd: divides by no number of processes the tests use
PAIRS = 5


def cnn() -> TinyCNN:
    torch.manual_seed(0)
    return TinyCNN().eval()


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(ITEMS, 3, 8, 8, generator=g), torch.randint(0, 5, (ITEMS,), generator=g))


def mlp() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).eval()


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(1, 3, 4, generator=g), torch.randn(1, 3, 4, generator=g)) for _ in range(PAIRS)]


def metric(out: torch.Tensor) -> torch.Tensor:
    return out[:, -1].mean()


class Slow:
    """A CAM that takes ``delay`` seconds more per batch (to kill a run in the middle); same settings as the CAM."""

    def __init__(self, cam: GradCAM, delay: float) -> None:
        self.cam, self.model, self.delay = cam, cam.model, delay

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        time.sleep(self.delay)
        return self.cam(inputs, target)

    def __repr__(self) -> str:
        return repr(self.cam)


def run(out: Path, shard_size: int, delay: float = 0.0) -> dict[str, Any]:
    """The dataset run, then the aggregates; returns what every process computed."""
    cam = GradCAM(cnn(), "features.2")
    method = Slow(cam, delay) if delay else cam
    results = attribute_dataset(method, images(), out, batch_size=2, shard_size=shard_size, progress=False)
    means = class_means(results)
    patching = mean_patching(mlp(), pairs(), ["0", "1"], metric, progress=False)
    return {
        "classes": means.classes,
        "means": means.means,
        "counts": means.counts,
        "patching_mean": patching.mean,
        "patching_std": patching.std,
        "patching_count": patching.count,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    args, cli = sys.argv[1:split], sys.argv[split + 1 :]
    out = Path(args[0])
    computed = run(out, int(args[1]), float(args[2]) if len(args) > 2 else 0.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(computed, out / f"aggregates-rank{rank}.pt")
    if cli:
        from attribution.cli import main

        main(cli)
