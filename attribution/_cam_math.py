"""Class-activation-map arithmetic: pure functions of activations and gradients ``(batch, channels, h, w)``."""

from __future__ import annotations

import math
from collections.abc import Callable

import einops
import torch
import torch.nn.functional as F

_EPS = 1e-12


def gradcam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Grad-CAM: ``ReLU(sum_k mean_ij(dS/dA_kij) * A_k)``."""
    weights = grads.mean(dim=(2, 3), keepdim=True)
    return F.relu((weights * acts).sum(dim=1))


def gradcam_plus_plus(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Grad-CAM++: ``w_k = sum_ij a_kij ReLU(g_kij)``, ``a = g^2 / (2 g^2 + sum_ab A_kab g^3)`` (0 where 0/0)."""
    g2 = grads.pow(2)
    denominator = 2 * g2 + acts.sum(dim=(2, 3), keepdim=True) * grads.pow(3)
    alpha = torch.where(denominator != 0, g2 / torch.where(denominator != 0, denominator, 1), 0)
    weights = (alpha * F.relu(grads)).sum(dim=(2, 3), keepdim=True)
    return F.relu((weights * acts).sum(dim=1))


def xgradcam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """XGrad-CAM: ``w_k = sum_ij (A_kij / sum_ab A_kab) g_kij``."""
    total = acts.sum(dim=(2, 3), keepdim=True)
    weights = (acts * grads).sum(dim=(2, 3), keepdim=True) / (total + _EPS)
    return F.relu((weights * acts).sum(dim=1))


def hirescam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """HiRes-CAM: ``ReLU(sum_k g_k * A_k)``, the gradient kept per position (no spatial averaging)."""
    return F.relu((grads * acts).sum(dim=1))


def layercam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """LayerCAM: ``ReLU(sum_k ReLU(g_k) * A_k)``."""
    return F.relu((F.relu(grads) * acts).sum(dim=1))


def eigencam(acts: torch.Tensor) -> torch.Tensor:
    """Eigen-CAM: activations projected on their first principal direction, ReLU.

    Per item, the ``(h*w, channels)`` matrix ``O`` (uncentred, as in the paper) is decomposed ``O = U S V^T`` and
    the map is ``O v_1``. A singular vector's sign is arbitrary: it is chosen so that the projection sums to a
    non-negative value.
    """
    h, w = acts.shape[-2:]
    matrix = einops.rearrange(acts, "b k h w -> b (h w) k")
    _, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    projection = matrix @ vh[:, 0, :, None]  # (b, hw, 1)
    sign = torch.where(projection.sum(dim=(1, 2), keepdim=True) < 0, -1.0, 1.0).to(projection.dtype)
    return F.relu(einops.rearrange(projection * sign, "b (h w) 1 -> b h w", h=h, w=w))


def weighted(acts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``ReLU(sum_k w_k A_k)`` for weights ``(batch, channels)`` (Score-CAM)."""
    return F.relu(torch.einsum("bk,bkhw->bhw", weights, acts))


def minmax(maps: torch.Tensor) -> torch.Tensor:
    """Scale each map of ``(batch, ...)`` to [0, 1]; a constant map becomes all zeros."""
    flat = maps.flatten(1)
    low = flat.min(dim=1).values.view(-1, *[1] * (maps.dim() - 1))
    span = flat.max(dim=1).values.view_as(low) - low
    return torch.where(span > 0, (maps - low) / torch.where(span > 0, span, 1), torch.zeros_like(maps))


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
    ``prefix_tokens`` tokens (class, distillation, register tokens) are dropped; when that number is not known, 0
    or 1 is used, whichever leaves a square number of tokens. ``pattern`` (an einops pattern such as
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
        for prefix in [prefix_tokens] if prefix_tokens is not None else [0, 1]:
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
