"""Class-activation-map arithmetic: pure functions of activations and gradients ``(batch, channels, h, w)``."""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F

_EPS = 1e-12


def gradcam_weights(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Grad-CAM's channel weights ``mean_ij dS/dA_kij``, ``(batch, channels, 1, 1)``."""
    return grads.mean(dim=(2, 3), keepdim=True)


def gradcam_plus_plus_weights(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Grad-CAM++: ``w_k = sum_ij a_kij ReLU(g_kij)``, ``a = g^2 / (2 g^2 + sum_ab A_kab g^3)`` (0 where 0/0)."""
    g2 = grads.pow(2)
    denominator = 2 * g2 + acts.sum(dim=(2, 3), keepdim=True) * grads.pow(3)
    alpha = torch.where(denominator != 0, g2 / torch.where(denominator != 0, denominator, 1), 0)
    return (alpha * F.relu(grads)).sum(dim=(2, 3), keepdim=True)


def xgradcam_weights(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """XGrad-CAM: ``w_k = sum_ij (A_kij / sum_ab A_kab) g_kij``."""
    total = acts.sum(dim=(2, 3), keepdim=True)
    return (acts * grads).sum(dim=(2, 3), keepdim=True) / (total + _EPS)


def hirescam_weights(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """HiRes-CAM: the gradient itself, kept per position (no spatial averaging)."""
    return grads


def layercam_weights(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """LayerCAM: the positive part of the gradient, per position."""
    return F.relu(grads)


def combine(weights: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
    """``ReLU(sum_k w_k * A_k)`` for weights per channel ``(b, k, 1, 1)`` or per position ``(b, k, h, w)``."""
    return F.relu((weights * acts).sum(dim=1))


def term_scale(weights: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
    """Per item, the largest per-position sum of ``|w_k * A_k|``: how large the map could be without cancellation."""
    return (weights * acts).abs().sum(dim=1).flatten(1).amax(dim=1)


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


def ablation_weights(score: torch.Tensor, ablated: torch.Tensor) -> torch.Tensor:
    """Ablation-CAM's channel weights ``(y - y_k) / y``: ``score`` ``(batch,)``, ``ablated`` ``(batch, channels)``.

    Example:
        >>> ablation_weights(torch.tensor([4.0]), torch.tensor([[3.0, 4.0, 6.0]]))
        tensor([[ 0.2500,  0.0000, -0.5000]])
    """
    return (score[:, None] - ablated) / score[:, None]
