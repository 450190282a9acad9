"""Graphs of the tiny float64 LMs, built once per session (the known-answer tests share them)."""

from __future__ import annotations

import pytest
import torch

from attribution.graphs import attribution_graph
from tests.attribution.models import lm64

IDS = torch.tensor([3, 7, 1, 9, 4, 2])


@pytest.fixture(scope="session")
def llama():
    return lm64("llama")


@pytest.fixture(scope="session")
def llama_graph(llama):
    return attribution_graph(llama, IDS, progress=False, batch_size=128)
