"""The pointing game (Zhang et al., 2016) and its energy-based form (Wang et al., 2020): does a map find the object?

Both compare a map with the object's region (boxes drawn by hand, or masks): no model is run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._run import warn
from ._similarity import constant_items


@dataclass(frozen=True)
class PointingResult:
    """One pointing-game outcome per map.

    Attributes:
        hit: ``(B,)`` bool: the map's peak lies within ``tolerance`` pixels of the region.
        energy: ``(B,)`` share of the map's positive mass inside the region, in [0, 1] (the energy-based pointing
            game); NaN for a map without positive values.
        peak: ``(B, 2)`` the ``(row, col)`` of each map's maximum (the first in raster order when tied).
    """

    hit: torch.Tensor
    energy: torch.Tensor
    peak: torch.Tensor


def pointing_game(maps: torch.Tensor, regions: Any, *, tolerance: float = 15) -> PointingResult:
    """The pointing game: a hit when the map's maximum falls on the object, within a tolerance.

    Zhang et al., *Top-down Neural Attention by Excitation Backprop*, ECCV 2016 (https://arxiv.org/abs/1608.00507):
    a hit when some pixel of the object's region lies closer than ``tolerance`` pixels to the map's peak (TorchRay's
    rule; 15 pixels in the paper). The energy-based form (Wang et al., *Score-CAM*, 2020,
    https://arxiv.org/abs/1910.01279) is the share of the map's positive mass inside the region,
    ``sum(relu(L) * region) / sum(relu(L))``.

    Args:
        maps: ``(B, H, W)`` saliency maps (or one ``(H, W)`` map), higher meaning more salient.
        regions: the objects, in the maps' pixels: boolean masks ``(B, H, W)``; boxes ``(B, 4)`` as
            ``(x1, y1, x2, y2)``; or a sequence of ``B`` box lists ``(k, 4)`` whose union is the region. A pixel
            ``(row, col)`` is inside a box when its centre ``(col + 0.5, row + 0.5)`` is: ``(0, 0, W, H)`` is the
            whole map, ``(10, 20, 30, 40)`` columns 10 to 29 of rows 20 to 39.
        tolerance: in pixels (Euclidean); 0 requires the peak pixel itself to be in the region.

    Returns:
        :class:`PointingResult`; the hit rate is ``result.hit.float().mean()``.

    Example:
        >>> import torch
        >>> maps = torch.zeros(2, 32, 32)
        >>> maps[0, 5, 5] = maps[1, 30, 30] = 1
        >>> result = pointing_game(maps, torch.tensor([[0, 0, 16, 16], [0, 0, 16, 16]]), tolerance=0)
        >>> result.hit.tolist(), result.energy.tolist()
        ([True, False], [1.0, 0.0])
    """
    if not isinstance(maps, torch.Tensor):
        raise TypeError(f"`maps` must be a tensor (B, H, W); got {type(maps).__name__}")
    if maps.dim() == 2:  # one map: one region (a mask, a box, or a list of boxes)
        maps = maps[None]
        regions = regions[None] if isinstance(regions, torch.Tensor) and regions.dtype == torch.bool else [regions]
    if maps.dim() != 3:
        raise ValueError(f"`maps` must be (B, H, W) or (H, W); got shape {tuple(maps.shape)}")
    if not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise ValueError(f"`tolerance` must be a number of pixels >= 0; got {tolerance!r}")
    mask = _region_masks(regions, maps.shape).to(maps.device)
    h, w = maps.shape[-2:]
    flat = maps.detach().float().flatten(1)
    peak_index = flat.nan_to_num(nan=-torch.inf).argmax(dim=1)
    peak = torch.stack([peak_index // w, peak_index % w], dim=1)
    rows = torch.arange(h, device=maps.device)[None, :, None] - peak[:, 0, None, None]
    cols = torch.arange(w, device=maps.device)[None, None, :] - peak[:, 1, None, None]
    distance2 = (rows**2 + cols**2).float()
    near = (distance2 < tolerance**2) | (distance2 == 0)
    hit = (near & mask).flatten(1).any(dim=1)
    positive = flat.clamp(min=0)
    total = positive.sum(dim=1)
    energy = (positive * mask.flatten(1)).sum(dim=1) / total
    unfinite = (~torch.isfinite(flat)).any(dim=1)
    if unfinite.any():
        hit[unfinite], energy[unfinite] = False, float("nan")
        warn(
            f"the map of item(s) {unfinite.nonzero().flatten().tolist()} holds NaN or inf: it has no peak, so it "
            "counts as a miss and its energy is NaN"
        )
    constant = [i for i in constant_items(flat) if not unfinite[i]]
    if constant:
        hit[constant] = False
        warn(
            f"the map of item(s) {constant} is constant: it points nowhere, so it counts as a miss",
        )
    return PointingResult(hit, energy, peak)


def _region_masks(regions: Any, shape: torch.Size) -> torch.Tensor:
    """``regions`` as boolean masks ``(B, H, W)``: masks are checked, boxes are drawn."""
    b, h, w = shape
    if isinstance(regions, torch.Tensor) and regions.dtype == torch.bool:
        if regions.shape != (b, h, w):
            raise ValueError(f"`regions` as masks must be (B, H, W) = {(b, h, w)}; got {tuple(regions.shape)}")
        masks = regions
    else:
        boxes: Sequence[Any]
        if isinstance(regions, torch.Tensor) and regions.dim() in (2, 3):
            boxes = list(regions)
        elif isinstance(regions, Sequence) and not isinstance(regions, (str, bytes)):
            boxes = regions
        else:
            raise TypeError(
                "`regions` must be boolean masks (B, H, W), boxes (B, 4) as (x1, y1, x2, y2), or a sequence of B "
                f"box lists (k, 4); got {type(regions).__name__}"
            )
        if len(boxes) != b:
            raise ValueError(f"{len(boxes)} regions for {b} maps; give one box (or box list) per map")
        masks = torch.stack([_draw(torch.as_tensor(box, dtype=torch.float64), h, w, i) for i, box in enumerate(boxes)])
    empty = (~masks.flatten(1).any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"the region of item(s) {empty} covers no pixel of the {h}x{w} map")
    return masks


def _draw(boxes: torch.Tensor, h: int, w: int, item: int) -> torch.Tensor:
    """The union of ``boxes`` ``(k, 4)`` as an ``(h, w)`` mask, by pixel centres."""
    if boxes.dim() == 1 and boxes.numel() == 4:
        boxes = boxes[None]
    if boxes.dim() != 2 or boxes.shape[1] != 4 or not len(boxes):
        raise ValueError(f"the boxes of item {item} must be (x1, y1, x2, y2) rows; got shape {tuple(boxes.shape)}")
    x1, y1, x2, y2 = boxes.unbind(dim=1)
    if ((x2 <= x1) | (y2 <= y1)).any():
        raise ValueError(f"a box of item {item} has x2 <= x1 or y2 <= y1; boxes are (x1, y1, x2, y2)")
    cy = torch.arange(h, dtype=torch.float64) + 0.5
    cx = torch.arange(w, dtype=torch.float64) + 0.5
    inside_y = (cy[None, :] >= y1[:, None]) & (cy[None, :] <= y2[:, None])  # (k, h)
    inside_x = (cx[None, :] >= x1[:, None]) & (cx[None, :] <= x2[:, None])  # (k, w)
    return (inside_y[:, :, None] & inside_x[:, None, :]).any(dim=0)
