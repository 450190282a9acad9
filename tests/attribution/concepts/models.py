"""Tiny float64 models and example sets for the concept tests (imported by the tests, not a conftest)."""

from __future__ import annotations

import torch
from torch import nn


def seeded(module: nn.Module, seed: int) -> nn.Module:
    """``module`` in float64 with weights drawn from a seeded generator (scaled by 1 / sqrt(fan-in))."""
    generator = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return module


def small_cnn(seed: int = 0) -> nn.Module:
    """Conv(3 -> 4, 3x3) ReLU Conv(4 -> 5, 3x3) ReLU, pooled, Linear(5 -> 3), on (3, 7, 6) images."""
    return seeded(
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 5, 3),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(5, 3),
        ),
        seed,
    )


def nonlinear_head(seed: int = 0) -> nn.Module:
    """Identity ("0", the site) then Linear(6 -> 9) Tanh Linear(9 -> 3): a concept in the input space."""
    return seeded(nn.Sequential(nn.Identity(), nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)), seed)


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded float64 normal examples."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
