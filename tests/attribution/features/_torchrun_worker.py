"""Run by ``torchrun --nproc_per_node=2``: feature_statistics over the planted data, the report saved by rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from attribution.features import Directions, feature_statistics


def setting() -> tuple[torch.nn.Module, torch.Tensor, Directions]:
    """The planted model, documents and units, the same in every process."""
    from tests.attribution.features.conftest import Planted

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(30, 5, generator=gen) * 2
    table[:, 4] = table[:, 4].clamp(min=0)
    ids = torch.randint(0, 30, (37, 9), generator=gen)
    return Planted(table), ids, Directions(torch.randn(4, 5, generator=gen), "embed")


OPTIONS = {"k": 5, "bands": 3, "samples": 3, "context": (2, 2), "coactivation": True, "batch_size": 3}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    model, ids, units = setting()
    report = feature_statistics(model, ids, units, progress=False, **OPTIONS)
    if torch.distributed.get_rank() == 0:
        report.save(out / "two.report")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
