"""Small models for the attribution tests (the reference data's architectures, written here)."""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import DATA


class SmallVGG(nn.Module):
    """VGG-like CNN of the Grad-CAM reference data: an in-place ReLU right after the target layer ``features.6``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(inplace=True), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def small_vgg() -> SmallVGG:
    model = SmallVGG()
    model.load_state_dict(torch.load(DATA / "gradcam" / "small_vgg_state.pt", weights_only=True))
    return model.eval()


def gradcam_reference() -> dict:
    return torch.load(DATA / "gradcam" / "gradcam_reference.pt", weights_only=True)
