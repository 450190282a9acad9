"""Dictionary trainings run the same in the test process and in each process of ``torchrun``.

Usage: python _parallel_worker.py OUT (under torchrun or alone, with the repository on PYTHONPATH). Each run's
dictionary is saved per rank as ``OUT/<name>/final-rank<r>.pt``; ``OUT/<name>/log-rank<r>.json`` says how many
checkpoints the process wrote and how many steps had an AuxK loss.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from attribution import SAE, Transcoder, train_dictionary
from attribution.dictionaries import _sparse
from attribution.dictionaries import train as train_module
from attribution.dictionaries.modules import Dictionary


class Tiny(nn.Module):
    """Tokens -> embedding -> Linear ("mlp")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mlp = nn.Embedding(10, 6), nn.Linear(6, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def rows(width: int, seed: int, count: int = 600) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))


def tokens() -> list[torch.Tensor]:
    return [torch.randint(1, 10, (8, 4), generator=torch.Generator().manual_seed(i)) for i in range(5)]


# name -> (the dictionary, the call's positional arguments but the dictionary, its keywords); float64 unless named
RUNS: dict[str, tuple[Callable[[], Dictionary], Callable[[], tuple[Any, Any, Any]], dict[str, Any]]] = {
    # 10 steps of 100 rows, then one row (rank 1 gets none); features dead after 100 rows: AuxK at every step
    "topk": (lambda: SAE(8, 48, k=1).double(), lambda: (None, rows(8, 0), None), {"tokens": 1001, "batch_size": 100}),
    "batchtopk": (  # the last batch of 63 rows: 32 and 31
        lambda: Transcoder(8, 4, 48, activation="batchtopk", k=1, skip=True).double(),
        lambda: (None, rows(12, 1), None),
        {"tokens": 963, "batch_size": 100},
    ),
    "relu": (
        lambda: SAE(8, 24, activation="relu").double(),
        lambda: (None, rows(8, 2), None),
        {"tokens": 1000, "batch_size": 50, "l1_coefficient": 0.3, "sparsity_warmup": 5},
    ),
    "jumprelu": (
        lambda: Transcoder(8, 4, 24, activation="jumprelu", skip=True).double(),
        lambda: (None, rows(12, 3), None),
        {"tokens": 1000, "batch_size": 50, "l0_coefficient": 0.1, "bandwidth": 0.3},
    ),
    # recorded from a model: 40 sequences of 4 tokens in 3 shards, recorded by both processes, then trained on
    "recorded": (lambda: SAE(6, 12, k=2).double(), lambda: (Tiny(), tokens(), "mlp"), {"batch_size": 16}),
    "topk-float32": (lambda: SAE(8, 48, k=2), lambda: (None, rows(8, 0), None), {"tokens": 1001, "batch_size": 100}),
}
COMMON = {"lr": 1e-2, "seed": 3, "checkpoint_every": 4, "progress": False}


def run(name: str, out: Path) -> Dictionary:
    """Train the run ``name`` into ``out / name``; returns the dictionary."""
    make, arguments, options = RUNS[name]
    model, data, site = arguments()
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # another start in each process: rank 0's is broadcast
    dictionary = make()
    return train_dictionary(model, data, site, dictionary, out=out / name, **options, **COMMON)


def main(out: Path) -> None:
    counts = {"checkpoints": 0, "auxk": 0}
    checkpoint, auxiliary = train_module._checkpoint, _sparse.dead_topk_pattern  # TopK's and BatchTopK's AuxK

    def counted_checkpoint(*args: Any) -> None:
        counts["checkpoints"] += 1
        checkpoint(*args)

    def counted_auxiliary(*args: Any) -> _sparse.Pattern:
        counts["auxk"] += 1
        return auxiliary(*args)

    train_module._checkpoint = counted_checkpoint  # type: ignore[assignment]
    _sparse.dead_topk_pattern = counted_auxiliary  # type: ignore[assignment]
    for name in RUNS:
        counts.update(checkpoints=0, auxk=0)
        dictionary = run(name, out)  # the first call starts the process group under torchrun
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(dictionary.state_dict(), out / name / f"final-rank{rank}.pt")
        (out / name / f"log-rank{rank}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
