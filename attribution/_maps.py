"""Tensor arithmetic shared by the families and the plots: precision, scaling, resizing, token grids, images, ranks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import einops
import numpy as np
import torch
import torch.nn.functional as F


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least: half, bfloat16 and integers become float32, float64 stays float64.

    Example:
        >>> at_least_float32(torch.ones(2, dtype=torch.half)).dtype, at_least_float32(torch.ones(2).double()).dtype
        (torch.float32, torch.float64)
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


def minmax(maps: torch.Tensor) -> torch.Tensor:
    """Scale each map of ``(batch, ...)`` to [0, 1]; a constant map becomes all zeros, a map with NaN all NaN."""
    flat = maps.flatten(1)
    low = flat.min(dim=1).values.view(-1, *[1] * (maps.dim() - 1))
    span = flat.max(dim=1).values.view_as(low) - low
    scaled = torch.where(span > 0, (maps - low) / torch.where(span > 0, span, 1), torch.zeros_like(maps))
    return torch.where(span.isnan(), span, scaled)


def upsample(maps: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """Bilinear resize of ``(batch, h, w)`` maps to ``size``, ``align_corners=False``."""
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def to_grid(
    x: torch.Tensor,
    prefix_tokens: int | None = None,
    pattern: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Bring a layer output to ``(batch, channels, h, w)``.

    4-D tensors are taken as they are. Token tensors ``(batch, tokens, channels)`` become a square grid: the first
    ``prefix_tokens`` tokens (class, distillation, register tokens) are dropped, unless only the whole token count is
    square (CaiT's blocks run before its class token joins); when that number is not known, 0 or 1 is used,
    whichever leaves a square number of tokens. ``pattern`` (an einops pattern such as
    ``"b h w c -> b c h w"``, or a callable) overrides all of this.

    Raises:
        ValueError: the tensor is not spatial, or the tokens do not form a square.
    """
    if pattern is not None:
        if callable(pattern):
            out = pattern(x)
        else:
            out = _rearrange(x, pattern)
        if not isinstance(out, torch.Tensor) or out.dim() != 4:
            raise ValueError(
                f"`reshape` must produce (batch, channels, h, w); it gave {tuple(getattr(out, 'shape', ()))}"
            )
        return out
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        tokens = x.shape[1]
        for prefix in [prefix_tokens, 0] if prefix_tokens is not None else [0, 1]:  # CaiT's blocks: no class token
            side = math.isqrt(tokens - prefix)
            if side * side == tokens - prefix and side > 0:
                return einops.rearrange(x[:, prefix:], "b (h w) c -> b c h w", h=side)
        raise ValueError(
            f"the layer output has shape {tuple(x.shape)}: {tokens} tokens"
            + (f" minus {prefix_tokens} prefix token(s)" if prefix_tokens is not None else " (or one less)")
            + " is not a square grid. Pass reshape='b (h w) c -> b c h w' with the sizes, or a callable"
        )
    raise ValueError(
        f"the layer output has shape {tuple(x.shape)}, which is not spatial: CAMs need (batch, channels, h, w) or "
        "(batch, tokens, channels). Choose a convolutional or transformer-block layer, or pass `reshape=`"
    )


def _rearrange(x: torch.Tensor, pattern: str) -> torch.Tensor:
    """einops.rearrange, inferring square ``h``/``w`` for patterns such as ``b (h w) c -> b c h w``."""
    try:
        return einops.rearrange(x, pattern)
    except einops.EinopsError:
        pass
    left = pattern.split("->")[0]
    if "(h w)" not in left.replace("  ", " "):
        raise ValueError(
            f"`reshape` pattern {pattern!r} does not fit a layer output of shape {tuple(x.shape)}"
        ) from None
    axes = left.split()
    position = axes.index("(h") if "(h" in axes else -1
    tokens = x.shape[position] if 0 <= position < x.dim() else -1
    side = math.isqrt(tokens) if tokens > 0 else 0
    try:
        return einops.rearrange(x, pattern, h=side)
    except einops.EinopsError as exc:
        raise ValueError(
            f"`reshape` pattern {pattern!r} does not fit a layer output of shape {tuple(x.shape)}: {exc}"
        ) from None


def to_rgb(image: Any, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> np.ndarray:
    """An image as a float array ``(H, W, 3)`` in [0, 1], normalisation undone.

    Args:
        image: tensor ``(C, H, W)`` or ``(H, W)``, numpy array ``(H, W, C)`` or ``(H, W)``, or a PIL image.
        mean: per-channel mean that was subtracted (tensors only).
        std: per-channel standard deviation that was divided by (tensors only).
    """
    if not isinstance(image, torch.Tensor) and np.asarray(image).ndim == 3:
        array = np.asarray(image)
        if array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3, 4):  # channel-first numpy: as a tensor
            image = torch.as_tensor(array)
    if isinstance(image, torch.Tensor):
        scale = 255.0 if image.dtype == torch.uint8 else 1.0
        x = image.detach().float().cpu() / scale
        while x.dim() > 3 and x.shape[0] == 1:  # a batch of one
            x = x[0]
        if x.dim() == 2:
            x = x[None]
        if x.dim() != 3:
            raise ValueError(f"`image` must be (C, H, W) or (H, W); got shape {tuple(image.shape)}")
        if std is not None:
            x = x * torch.as_tensor(std, dtype=x.dtype)[:, None, None]
        if mean is not None:
            x = x + torch.as_tensor(mean, dtype=x.dtype)[:, None, None]
        if x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        array = x.permute(1, 2, 0).numpy()
        if mean is None and std is None and (array.min() < 0 or array.max() > 1):  # an unknown scale: stretch it
            array = (array - array.min()) / max(float(array.max() - array.min()), 1e-12)
        return np.clip(array, 0, 1)
    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    if array.max() > 1:
        array = array / 255.0
    return np.clip(array[..., :3], 0, 1)


def map_array(saliency: Any, size: tuple[int, int]) -> np.ndarray:
    """A saliency map as ``(H, W)`` numpy, bilinearly resized to ``size`` when needed."""
    s = torch.as_tensor(np.asarray(saliency.detach().cpu() if isinstance(saliency, torch.Tensor) else saliency))
    s = s.float().squeeze()
    if s.dim() != 2:
        raise ValueError(f"a saliency map must be (H, W); got shape {tuple(s.shape)}")
    if tuple(s.shape) != size:
        s = F.interpolate(s[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
    return s.numpy()


# -- rank correlation (the metrics and the plots) ---------------------------------------------------------------
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
