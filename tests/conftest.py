"""Shared fixtures: small seeded models built on the spot (no weights are downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest
import torch
from torch import nn

matplotlib.use("Agg")
torch.set_num_threads(min(2, os.cpu_count() or 1))

DATA = Path(__file__).parent / "data"
collect_ignore_glob = ["data/*"]  # programs kept as data (TackleBox's scripts), not tests


class TinyCNN(nn.Module):
    """Conv -> in-place ReLU -> conv -> ReLU -> pool -> linear: small, with an in-place op after a layer."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.features(x)).flatten(1))


@pytest.fixture
def tiny_cnn() -> TinyCNN:
    torch.manual_seed(0)
    return TinyCNN().eval()


@pytest.fixture
def resnet18() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


@pytest.fixture
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def hook_state(model: nn.Module) -> dict[str, tuple]:
    """Every hook-related dict of every module, as comparable values (to check nothing was left behind)."""
    attrs = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
    )
    state = {}
    for name, module in model.named_modules():
        public = tuple(sorted(k for k in module.__dict__ if not k.startswith("_") or k == "__getstate__"))
        state[name] = (*(tuple(getattr(module, a).items()) for a in attrs), public)
    return state
