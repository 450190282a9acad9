"""Run by torchrun with two processes: an EK-FAC fit and its scores, written by rank 0 (test_fit_passes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from attribution.influence import InfluenceFunction


def setting() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """A float64 MLP, 5 training batches of uneven size, a test batch."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(23, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (23,), generator=g)
    train = [(x[i : i + 5], y[i : i + 5]) for i in range(0, 23, 5)]
    return model, train, (torch.randn(4, 5, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))


def fitted(method: str = "ekfac") -> tuple[InfluenceFunction, torch.Tensor, torch.Tensor]:
    model, train, test = setting()
    influence = InfluenceFunction(model, nn.CrossEntropyLoss(reduction="none"), method=method, progress=False)
    influence.fit(train)
    return influence, influence.scores(test, train), influence.self_influence(train)


if __name__ == "__main__":
    torch.set_num_threads(1)
    influence, scores, self_influence = fitted()
    if torch.distributed.get_rank() == 0:
        torch.save({"state": influence.state, "scores": scores, "self": self_influence}, Path(sys.argv[1]) / "two.pt")
