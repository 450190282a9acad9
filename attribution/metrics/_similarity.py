"""How alike two batches of maps are: SSIM per item (pure functions of tensors); Spearman is in ``.._maps``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
"""Side of SSIM's Gaussian window (Wang et al., 2004)."""
SSIM_SIGMA = 1.5
"""Standard deviation of SSIM's Gaussian window."""


def constant_items(maps: torch.Tensor) -> list[int]:
    """The items of ``maps`` ``(B, ...)`` whose values are all equal (an all-zero map): no order, no variance."""
    flat = maps.flatten(1)
    return (flat == flat[:, :1]).all(dim=1).nonzero().flatten().tolist()


def ssim(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0) -> torch.Tensor:
    """Mean structural similarity ``(B,)`` of the maps ``a`` and ``b`` ``(B, H, W)`` (Wang et al., 2004).

    Gaussian window of side 11 and sigma 1.5, ``K1 = 0.01``, ``K2 = 0.03``, population (co)variances, averaged over
    the positions where the window fits inside the map: scikit-image's ``structural_similarity(a, b,
    data_range=data_range, gaussian_weights=True, sigma=1.5, use_sample_covariance=False)``.
    """
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(
            f"SSIM needs two batches of maps (B, H, W) of one shape; got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if min(a.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs maps of at least {SSIM_WINDOW}x{SSIM_WINDOW} pixels; got {tuple(a.shape[-2:])}")
    x, y = a.double()[:, None], b.double()[:, None]
    radius = SSIM_WINDOW // 2
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64, device=x.device)
    bell = torch.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    bell = bell / bell.sum()
    window = torch.outer(bell, bell)[None, None]

    def mean(z: torch.Tensor) -> torch.Tensor:
        return F.conv2d(z, window)

    mx, my = mean(x), mean(y)
    vx, vy, cxy = mean(x * x) - mx**2, mean(y * y) - my**2, mean(x * y) - mx * my
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return s.flatten(1).mean(dim=1)
