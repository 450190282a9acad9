"""Pixel orderings, step counts, baselines and areas: pure functions of tensors, shared by the perturbation metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch

Baseline = Union[str, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]  # noqa: UP007

BLUR_KERNEL = 11
"""Side of the Gaussian kernel of the ``"blur"`` baseline, in pixels (RISE's ``klen``)."""
BLUR_SIGMA = 5.0
"""Standard deviation of the Gaussian kernel of the ``"blur"`` baseline, in pixels (RISE's ``ksig``)."""


def pixel_ranks(maps: torch.Tensor) -> torch.Tensor:
    """Rank ``(B, H*W)`` of every pixel of ``maps`` ``(B, H, W)``: 0 for the most salient, ties in raster order.

    The order is a stable descending sort of the flattened map, so pixels of equal value (the zeros a ReLU leaves)
    keep their row-major order, the convention of torchcam's ``DeletionInsertionMetric``.
    """
    flat = maps.flatten(1)
    order = torch.argsort(flat, dim=1, descending=True, stable=True)
    positions = torch.arange(flat.shape[1], device=flat.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def step_counts(pixels: int, steps: int) -> torch.Tensor:
    """How many pixels are perturbed at each of the ``steps + 1`` points of a curve: ``floor(k * pixels / steps)``."""
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= pixels:
        raise ValueError(f"`steps` must be an int from 1 to the number of pixels ({pixels}); got {steps!r}")
    return torch.arange(steps + 1) * pixels // steps


def replace_top(
    source: torch.Tensor, fill: torch.Tensor, ranks: torch.Tensor, items: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Copies of ``source[items]`` whose ``counts`` highest-ranked pixels come from ``fill[items]``.

    Args:
        source: ``(B, C, H, W)`` images the copies start from.
        fill: ``(B, C, H, W)`` values put in place of the replaced pixels (all channels of a pixel together).
        ranks: ``(B, H*W)`` pixel ranks (see :func:`pixel_ranks`).
        items: ``(n,)`` which image each copy is made of.
        counts: ``(n,)`` how many pixels each copy takes from ``fill``.

    Returns:
        ``(n, C, H, W)``.
    """
    replaced = ranks[items] < counts[:, None].to(ranks.device)
    flat = torch.where(replaced[:, None, :], fill.flatten(2)[items], source.flatten(2)[items])
    return flat.view(len(items), *source.shape[1:])


def blur(images: torch.Tensor, kernel_size: int = BLUR_KERNEL, sigma: float = BLUR_SIGMA) -> torch.Tensor:
    """Gaussian blur of ``(B, C, H, W)`` images, reflected at the borders (torchvision's ``gaussian_blur``)."""
    from torchvision.transforms.v2.functional import gaussian_blur  # torchvision is slow to import: only when used

    if min(images.shape[-2:]) <= kernel_size // 2:
        raise ValueError(
            f"the 'blur' baseline reflects a {kernel_size}x{kernel_size} kernel at the borders, which needs images of "
            f"more than {kernel_size // 2} pixels a side; got {tuple(images.shape[-2:])}: pass baseline='zeros' or "
            "'mean'"
        )
    return gaussian_blur(images, [kernel_size, kernel_size], [sigma, sigma])


def make_baseline(baseline: Baseline, images: torch.Tensor) -> torch.Tensor:
    """The ``(B, C, H, W)`` values that replace removed pixels.

    ``"zeros"``: 0 everywhere (the mean colour of a normalised dataset); ``"mean"``: each image's per-channel mean;
    ``"blur"``: the image blurred (:func:`blur`); a tensor broadcastable to the images; or a callable
    ``images -> tensor`` of their shape.
    """
    if isinstance(baseline, str):
        if baseline == "zeros":
            return torch.zeros_like(images)
        if baseline == "mean":
            return images.mean(dim=(2, 3), keepdim=True).expand_as(images)
        if baseline == "blur":
            return blur(images)
        raise ValueError(f"`baseline` must be 'zeros', 'mean', 'blur', a tensor or a callable; got {baseline!r}")
    made = baseline(images) if callable(baseline) else baseline
    if not isinstance(made, torch.Tensor):
        raise TypeError(
            f"`baseline` must be 'zeros', 'mean', 'blur', a tensor or a callable returning a tensor; got "
            f"{type(made).__name__}"
        )
    try:
        return torch.broadcast_to(made.to(images), images.shape)
    except RuntimeError:
        raise ValueError(
            f"`baseline` of shape {tuple(made.shape)} does not broadcast to the inputs' shape {tuple(images.shape)}"
        ) from None


def auc(fractions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Area ``(B,)`` under each curve of ``scores`` ``(B, P)`` over ``fractions`` ``(P,)``, by the trapezoid rule."""
    return torch.trapezoid(scores, fractions.to(scores), dim=1)


def derived_seed(seed: int, *keys: int) -> int:
    """A seed for one part of a run (a stage, an image, a curve): a hash of ``(seed, *keys)``, equal in every process.

    Example:
        >>> derived_seed(0, 1) == derived_seed(0, 1) != derived_seed(0, 2)
        True
    """
    return hash((seed, *keys)) & 0x7FFF_FFFF_FFFF_FFFF
