"""The tensor math of the attacks: sign steps, projections onto the balls, random starts. Pure functions of tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ZERO_GRADIENT = 1e-6
"""A gradient entry at most this large in magnitude leaves its input value where it is (captum's ``zero_thresh``)."""

NORMS = ("Linf", "L2")


def sign_step(
    x: torch.Tensor, grad: torch.Tensor, step: float, targeted: bool, mask: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """One FGSM step: ``x + step * sign(grad) * mask`` (``-`` when ``targeted``), where ``|grad| > 1e-6``.

    Untargeted, the step climbs the loss; targeted, it descends it (towards the target class).

    Example:
        >>> sign_step(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.5, -2.0, 1e-9]), 0.1, False)
        tensor([1.1000, 0.9000, 1.0000])
    """
    direction = -1 if targeted else 1
    return torch.where(grad.abs() > ZERO_GRADIENT, x + direction * step * torch.sign(grad) * mask, x)


def project(center: torch.Tensor, x: torch.Tensor, radius: float, norm: str) -> torch.Tensor:
    """``x`` moved back into the ball of ``radius`` around ``center``, item by item (first axis).

    ``"Linf"`` clamps each value of ``x - center`` to ``[-radius, radius]``; ``"L2"`` rescales an item's
    ``x - center`` whose 2-norm exceeds ``radius`` to that norm (``torch.renorm``, which divides by the norm plus
    1e-7, so the result lies just inside).

    Example:
        >>> project(torch.zeros(1, 2), torch.tensor([[3.0, 4.0]]), 1.0, "L2")
        tensor([[0.6000, 0.8000]])
    """
    difference = x - center
    if norm == "Linf":
        return center + torch.clamp(difference, -radius, radius)
    return center + torch.renorm(difference, 2, 0, radius)


def random_start(
    center: torch.Tensor, radius: float, norm: str, mask: torch.Tensor | float, generator: torch.Generator
) -> torch.Tensor:
    """A random point of the ball of ``radius`` around each item of ``center``, where ``mask`` lets it move.

    ``"Linf"``: each value moved by ``u * 2 radius - radius``, ``u`` uniform in ``[0, 1)`` in ``center``'s dtype.
    ``"L2"``: a Gaussian direction per item, normalised, times ``radius * v^(1/d)`` with ``v`` uniform (one per
    item, drawn in the default dtype) and ``d`` the values per item: uniform in the ball. Draws come from
    ``generator`` in captum's order (the direction, then the radii), so a generator seeded as ``torch.manual_seed``
    gives captum's points.
    """
    dtype, device = center.dtype, center.device
    if norm == "Linf":
        noise = torch.rand(center.shape, generator=generator, dtype=dtype, device=device)
        return center + (noise * radius * 2 - radius) * mask
    direction = torch.randn(center.shape, generator=generator, dtype=dtype, device=device)
    unit = F.normalize(direction.view(len(center), -1)).view(center.shape)
    per_item = center[0].numel()
    radii = torch.rand(len(center), generator=generator, device=center.device) ** (1.0 / per_item) * radius
    return center + radii.view(-1, *[1] * (center.dim() - 1)) * unit * mask
