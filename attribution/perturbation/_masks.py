"""Feature masks, baselines, occlusion windows and RISE masks: pure functions of tensors and shapes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import nn

Baseline = Union[None, int, float, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]  # noqa: UP007
"""What ``baseline=`` takes: ``None`` (the default), a number, a tensor like one item or the batch, or a callable."""


def feature_ids(feature_mask: torch.Tensor | None, item: Sequence[int]) -> tuple[torch.Tensor, int]:
    """The feature of every element of one item, ``item``-shaped (long), and the number of features ``M``.

    ``None`` gives one feature per element. A mask must be an integer tensor broadcastable to ``item`` (a leading
    axis of 1 is allowed, captum's ``(1, ...)``) whose ids are exactly ``0..M-1``.

    Example:
        >>> feature_ids(torch.tensor([[0], [1]]), (2, 3))
        (tensor([[0, 0, 0],
                [1, 1, 1]]), 2)
    """
    item = tuple(int(n) for n in item)
    if feature_mask is None:
        count = math.prod(item)
        return torch.arange(count).view(item), count
    if not isinstance(feature_mask, torch.Tensor):
        raise TypeError(f"`feature_mask` must be an integer tensor; got {type(feature_mask).__name__}")
    if feature_mask.is_floating_point() or feature_mask.is_complex() or feature_mask.dtype == torch.bool:
        raise TypeError(f"`feature_mask` must hold integer feature ids; got {feature_mask.dtype}")
    mask = feature_mask
    if mask.dim() == len(item) + 1 and mask.shape[0] == 1:
        mask = mask[0]
    try:
        ids = torch.broadcast_to(mask, item).long()
    except RuntimeError:
        raise ValueError(
            f"`feature_mask` of shape {tuple(feature_mask.shape)} does not broadcast to one item of shape {item}: "
            "give one id per element of an item, or a shape that broadcasts to it (e.g. (1, H, W) for (C, H, W))"
        ) from None
    present = torch.unique(ids)
    count = int(present.max()) + 1 if present.numel() else 0
    if present.numel() and int(present.min()) < 0:
        raise ValueError(f"`feature_mask` ids must be 0..M-1; it holds negative ids {present[present < 0].tolist()}")
    if present.numel() != count:
        missing = sorted(set(range(count)) - set(present.tolist()))
        shown = str(missing[:10])[:-1] + (", ...]" if len(missing) > 10 else "]")
        raise ValueError(
            f"`feature_mask` ids must be 0..M-1 with every id present; ids {shown} are missing (the largest is "
            f"{count - 1}): renumber them, e.g. torch.unique(mask, return_inverse=True)[1]"
        )
    return ids.to(feature_mask.device), count


def default_token(model: nn.Module) -> int:
    """The baseline token of a language model: ``pad_token_id``, else ``eos_token_id`` (its first), else 0."""
    config = getattr(model, "config", None)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def baseline_batch(baseline: Baseline, x: torch.Tensor, model: nn.Module, *, of: str = "`inputs`") -> torch.Tensor:
    """The baseline expanded to ``x`` ``(batch, ...)``, checked (float inputs: 0 by default; token ids: a token).

    ``of`` names ``x`` in errors (the output of a ``layer``, where that is what is perturbed).

    Example:
        >>> baseline_batch(torch.tensor([1.0, 2.0]), torch.zeros(3, 2), torch.nn.Identity())
        tensor([[1., 2.],
                [1., 2.],
                [1., 2.]])
    """
    if baseline is None:
        baseline = 0 if x.is_floating_point() else default_token(model)
    if isinstance(baseline, (int, float)) and not isinstance(baseline, bool):
        if not x.is_floating_point() and not float(baseline).is_integer():
            raise TypeError(f"`baseline` {baseline} is not a token id, but {of} are {x.dtype} ids")
        return torch.full_like(x, baseline)
    base: Any = baseline(x) if callable(baseline) else baseline
    what = "the baseline that `baseline` returned" if callable(baseline) else "`baseline`"
    if not isinstance(base, torch.Tensor):
        raise TypeError(f"{what} must be a number or a tensor; got {type(base).__name__}")
    if tuple(base.shape) not in (tuple(x.shape), tuple(x.shape[1:]), (1, *x.shape[1:])):
        raise ValueError(
            f"{what} has shape {tuple(base.shape)}, but {of} are {tuple(x.shape)}: give a baseline shaped like "
            f"one item {tuple(x.shape[1:])}, like the batch {tuple(x.shape)}, or a number"
        )
    if base.is_floating_point() != x.is_floating_point():
        raise TypeError(f"{what} is {base.dtype} but {of} are {x.dtype}: give a baseline of the same kind")
    return base.to(device=x.device, dtype=x.dtype).expand_as(x).clone()


def sizes(value: int | Sequence[int], item: Sequence[int], what: str) -> tuple[int, ...]:
    """A window or stride: one positive size per item dimension (an integer means that size everywhere)."""
    item = tuple(int(n) for n in item)
    if isinstance(value, bool) or not isinstance(value, (int, Sequence)):
        raise TypeError(f"{what} must be an integer or one integer per item dimension; got {type(value).__name__}")
    given = (value,) * len(item) if isinstance(value, int) else tuple(value)
    if len(given) != len(item) or not all(isinstance(n, int) and n >= 1 for n in given):
        raise ValueError(
            f"{what} {tuple(given) if not isinstance(value, int) else value} must give one positive size per "
            f"dimension of an item of shape {item} ({len(item)} sizes)"
        )
    return given


def occlusion_starts(item: Sequence[int], window: Sequence[int], stride: Sequence[int]) -> list[tuple[int, ...]]:
    """The corner of every window, captum's order (the first dimension fastest), last windows cut at the edge.

    Along a dimension of size ``n`` there are ``ceil((n - w) / s) + 1`` windows starting at ``0, s, 2s, ...``; where
    ``s`` does not divide ``n - w`` the last one runs past the edge and is cut there (captum's ``Occlusion``).

    Example:
        >>> occlusion_starts((5,), (2,), (2,))
        [(0,), (2,), (4,)]
    """
    counts = [math.ceil((n - w) / s) + 1 for n, w, s in zip(item, window, stride, strict=True)]
    starts = []
    for k in range(math.prod(counts)):
        corner = []
        for count, s in zip(counts, stride, strict=True):
            corner.append((k % count) * s)
            k //= count
        starts.append(tuple(corner))
    return starts


def window_masks(item: Sequence[int], window: Sequence[int], corners: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """``(len(corners), *item)`` booleans: True inside each window (cut at the item's edge)."""
    masks = torch.zeros(len(corners), *item, dtype=torch.bool)
    for k, corner in enumerate(corners):
        where = tuple(slice(c, c + w) for c, w in zip(corner, window, strict=True))
        masks[k][where] = True
    return masks


def rise_masks(grids: torch.Tensor, shifts: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """RISE's masks ``(N, H, W)``: binary ``(N, s, s)`` grids upsampled bilinearly and shifted (Petsiuk et al.).

    Each grid is upsampled to ``(s + 1) * cell`` with ``cell = ceil(H / s), ceil(W / s)`` and cropped to ``(H, W)``
    at its shift ``(dy, dx)`` (``0 <= dy < cell_h``, ``0 <= dx < cell_w``).

    Example:
        >>> rise_masks(torch.ones(1, 2, 2), torch.zeros(1, 2, dtype=torch.long), (3, 3)).shape
        torch.Size([1, 3, 3])
    """
    cells = grids.shape[-1]
    h, w = size
    cell_h, cell_w = math.ceil(h / cells), math.ceil(w / cells)
    up = nn.functional.interpolate(
        grids[:, None].double(), size=((cells + 1) * cell_h, (cells + 1) * cell_w), mode="bilinear", align_corners=False
    )[:, 0]
    rows = shifts[:, 0, None] + torch.arange(h)  # (N, H)
    cols = shifts[:, 1, None] + torch.arange(w)  # (N, W)
    index = torch.arange(len(grids))[:, None, None]
    return up[index, rows[:, :, None], cols[:, None, :]]
