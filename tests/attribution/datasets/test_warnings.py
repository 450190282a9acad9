"""attribute_dataset warns once per cause in a run, where the method alone warns at every batch."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset

ITEMS = 11  # three batches of 4


def _pooled_cam() -> GradCAM:
    """Grad-CAM at a layer after global pooling: a 1x1 grid, which the CAMs warn about at every call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    return GradCAM(model.eval(), "2")


def _messages(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_a_warning_of_the_method_comes_once_per_run_naming_its_first_batch(tmp_path: Path) -> None:
    images = torch.randn(ITEMS, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    cam = _pooled_cam()
    alone = _messages(lambda: [cam(images[i : i + 4], 0) for i in range(0, ITEMS, 4)])
    assert sum("1x1 grid" in m for m in alone) == 3  # one per batch

    def run(out: Path) -> list[str]:
        return _messages(lambda: attribute_dataset(cam, TensorDataset(images), out, batch_size=4, progress=False))

    first = run(tmp_path / "a")
    assert len(first) == 1
    assert first[0] == alone[0] + (
        " (attribute_dataset warns once per cause in a run; first seen in the batch of dataset items 0 to 3, which a "
        "method's own messages number from 0)"
    )
    assert len(run(tmp_path / "b")) == 1  # per run, not per process
    assert len(_messages(lambda: cam(images[:4], 0))) == 1  # and the method alone warns as before
