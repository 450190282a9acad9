"""What tests import: the data folder, a tiny CNN, a snapshot of every hook dict, figures as pixels."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.image
import numpy as np
import torch
from torch import nn

DATA = Path(__file__).parent / "data"


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


def render(fig) -> np.ndarray:
    """The figure as an RGB array, through a real PNG (the figure is closed)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=50)
    plt.close(fig)
    buffer.seek(0)
    return matplotlib.image.imread(buffer)[..., :3]
