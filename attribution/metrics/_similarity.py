"""How alike two batches of maps are: Spearman rank correlation and SSIM, per item (pure functions of tensors)."""

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


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks ``(B, N)`` of each row of ``values``, 0-based, tied values sharing the mean of their ranks."""
    ordered, order = values.sort(dim=1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group = starts.cumsum(dim=1) - 1  # (B, N): which run of equal values each sorted position belongs to
    positions = torch.arange(values.shape[1], dtype=torch.float64, device=values.device).expand(values.shape)
    total = torch.zeros_like(positions).scatter_add_(1, group, positions)
    size = torch.zeros_like(positions).scatter_add_(1, group, torch.ones_like(positions))
    mean = (total / size.clamp(min=1)).gather(1, group)
    return torch.empty_like(mean).scatter_(1, order, mean)


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation ``(B,)`` between the maps ``a`` and ``b`` ``(B, ...)``, ties given average ranks.

    The Pearson correlation of the ranks; NaN where a map is constant (its ranks have no variance).
    """
    ra, rb = average_ranks(a.flatten(1).double()), average_ranks(b.flatten(1).double())
    ra = ra - ra.mean(dim=1, keepdim=True)
    rb = rb - rb.mean(dim=1, keepdim=True)
    rho = (ra * rb).sum(dim=1) / (ra.norm(dim=1) * rb.norm(dim=1))
    return torch.where(unfinite_items(a) | unfinite_items(b), torch.nan, rho)


def unfinite_items(maps: torch.Tensor) -> torch.Tensor:
    """``(B,)``: whether each map holds a NaN or an infinity (it has no ranks: its correlations are NaN)."""
    return (~torch.isfinite(maps.flatten(1))).any(dim=1)


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
