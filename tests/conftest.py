"""Fixtures every test package shares: small seeded models built on the spot (no weights are downloaded)."""

from __future__ import annotations

import os

import matplotlib
import pytest
import torch
from torch import nn

from tests.support import TinyCNN

matplotlib.use("Agg")
# under pytest-xdist (the README's `-n 2`) each worker takes one core
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

collect_ignore_glob = ["data/*"]  # programs kept as data (TackleBox's scripts), not tests

FIRST = ("tests/test_examples.py", "tests/test_docs.py")
"""The longest files, run first: under ``--dist loadfile`` one worker takes them while the other runs the rest."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))


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
