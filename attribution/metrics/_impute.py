"""Noisy linear imputation (Rong et al., 2022): removed pixels become the weighted mean of their neighbours, plus noise.

Each removed pixel ``i`` gets the value that makes it the weighted mean of its 8 neighbours inside the image,

    x_i = sum_j w_ij x_j / sum_j w_ij,     w = 1/6 for the 4 direct neighbours, 1/12 for the 4 diagonal ones,

where the neighbours may themselves be removed: one sparse linear system per image, shared by its channels (the
system of ROAD's ``NoisyLinearImputer``). Written ``K x = b`` over the removed pixels, ``K = D - W`` is symmetric
positive definite as soon as one pixel is kept, so it is solved by conjugate gradients, preconditioned by one
multigrid V-cycle (a Jacobi sweep before and after, bilinear transfer, the same stencil on coarser grids, an exact
solve on the coarsest), all in tensor operations batched over images (about eight 224x224 RGB images at a time, so
that the arrays stay in cache) and channels. Solved to a relative residual of 1e-5 (float32) or 1e-10 (float64),
the values agree with a direct sparse solve to a few 1e-4 on 224x224 float32 images (far below ROAD's noise of
0.01) and to 1e-7 in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._run import warn

_COARSEST = 8  # grids are halved while both sides are longer than this; the coarsest is solved exactly
_MAX_ITERATIONS = 100
_SOLVE_ELEMENTS = 8 * 3 * 224 * 224  # values per solve: 8 RGB images of 224x224 are about 25% faster per image than 32
# on a 2-core AMD EPYC (the solver's dozens of passes per iteration then run on arrays that stay in cache); 4 are slower


class _Grid(NamedTuple):
    """One level of the multigrid hierarchy: which pixels are unknown, and the diagonal of ``K`` there."""

    unknown: torch.Tensor  # (n, 1, h, w), 1 at the unknown pixels
    diagonal: torch.Tensor  # (n, 1, h, w), the sum of the in-image neighbour weights at unknown pixels, else 0
    inverse: torch.Tensor  # (n, 1, h, w), 1 / diagonal at unknown pixels, else 0


def _neighbour_sum(x: torch.Tensor) -> torch.Tensor:
    """``sum_j w_ij x_j`` over the 8 neighbours inside the grid: ``([1 2 1] x [1 2 1] - 4 delta) / 12``, zero outside.

    Shifted in-place additions on slices rather than a convolution (several times faster than oneDNN's on
    single-channel 3x3 kernels) or padding (a copy of the grid).
    """
    rows = x * 2
    rows[..., 1:].add_(x[..., :-1])
    rows[..., :-1].add_(x[..., 1:])
    total = rows * 2
    total[..., 1:, :].add_(rows[..., :-1, :])
    total[..., :-1, :].add_(rows[..., 1:, :])
    return total.sub_(x, alpha=4).mul_(1 / 12)


def _apply(grid: _Grid, x: torch.Tensor) -> torch.Tensor:
    """``K x`` for ``x`` zero outside the unknown pixels."""
    return torch.addcmul(grid.diagonal * x, grid.unknown, _neighbour_sum(x), value=-1)


def _prolong_axis(e: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Linear interpolation along ``axis`` to twice the length (cell-centred: weights 3/4 and 1/4), cut to ``size``."""
    padded = F.pad(e, (1, 1) if axis == -1 else (0, 0, 1, 1))
    n = e.shape[axis]
    before, after = padded.narrow(axis, 0, n), padded.narrow(axis, 2, n)
    even = torch.add(e, before, alpha=1 / 3).mul_(0.75)  # 3/4 e[i] + 1/4 e[i-1]
    odd = torch.add(e, after, alpha=1 / 3).mul_(0.75)  # 3/4 e[i] + 1/4 e[i+1]
    both = torch.stack([even, odd], dim=axis)  # (..., n, 2, ...) -> (..., 2n, ...)
    shape = list(e.shape)
    shape[axis] = 2 * n
    return both.reshape(shape).narrow(axis, 0, size)


def _restrict_axis(r: torch.Tensor, axis: int) -> torch.Tensor:
    """The transpose of :func:`_prolong_axis`: ``c[i] = 3/4 (r[2i] + r[2i+1]) + 1/4 (r[2i-1] + r[2i+2])``."""
    pad = (0, 1) if axis == -1 else (0, 0, 0, 1)
    if r.shape[axis] % 2:
        r = F.pad(r, pad)
    n = r.shape[axis] // 2
    shape = list(r.shape)
    shape[axis : axis + 1 or None] = [n, 2]
    pairs = r.reshape(shape)
    even, odd = pairs.select(axis, 0), pairs.select(axis, 1)
    around = (1, 1) if axis == -1 else (0, 0, 1, 1)
    out = torch.add(even, odd).mul_(0.75)
    out.add_(F.pad(odd, around).narrow(axis, 0, n), alpha=0.25)  # r[2i-1]
    return out.add_(F.pad(even, around).narrow(axis, 2, n), alpha=0.25)  # r[2i+2]


def _restrict(r: torch.Tensor) -> torch.Tensor:
    """Full-weighting restriction to the grid of half the size (the transpose of :func:`_prolong`)."""
    return _restrict_axis(_restrict_axis(r, -1), -2)


def _prolong(e: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """Bilinear interpolation from a grid to the one of twice its size, cut to ``size``."""
    return _prolong_axis(_prolong_axis(e, -1, size[1]), -2, size[0])


def _grid(inside: torch.Tensor, unknown: torch.Tensor) -> _Grid:
    diagonal = _neighbour_sum(inside) * unknown
    inverse = torch.where(unknown > 0, 1 / diagonal.clamp(min=1e-12), torch.zeros_like(diagonal))
    return _Grid(unknown, diagonal, inverse)


def _hierarchy(unknown: torch.Tensor) -> tuple[list[_Grid], torch.Tensor]:
    """The grids, finest first, and the inverse ``(n, h*w, h*w)`` of ``K`` on the coarsest grid.

    A coarse pixel is unknown when none of its fine pixels is known; ``K`` is given the identity at known pixels.
    """
    inside = torch.ones_like(unknown)
    grids = [_grid(inside, unknown)]
    while min(unknown.shape[-2:]) > _COARSEST:
        h, w = unknown.shape[-2:]
        pad = (0, w % 2, 0, h % 2)
        known = F.pad(inside - unknown, pad)
        inside = F.max_pool2d(F.pad(inside, pad), 2)
        unknown = inside * (1 - F.max_pool2d(known, 2))
        grids.append(_grid(inside, unknown))
    coarsest = grids[-1]
    h, w = coarsest.unknown.shape[-2:]
    probes = torch.eye(h * w, dtype=unknown.dtype, device=unknown.device).view(1, h * w, h, w)
    columns = _apply(coarsest, probes * coarsest.unknown)  # (n, h*w probes, h, w): column j of K
    matrix = columns.flatten(2).transpose(1, 2) + torch.diag_embed(1 - coarsest.unknown.flatten(1))
    return grids, torch.cholesky_inverse(torch.linalg.cholesky(matrix))


def _v_cycle(grids: list[_Grid], inverse: torch.Tensor, r: torch.Tensor, level: int = 0) -> torch.Tensor:
    """An approximation of ``K^-1 r``: a symmetric V-cycle, so that it can precondition conjugate gradients."""
    grid = grids[level]
    if level == len(grids) - 1:
        n, c, h, w = r.shape
        return torch.bmm(r.flatten(2), inverse).view(n, c, h, w) * grid.unknown  # r K^-1 = (K^-1 r) as K^-1 = K^-T
    e = grid.inverse * r  # one Jacobi sweep from zero; its residual r - K e is then U S(e), S the neighbour sum
    coarse = _restrict(grid.unknown * _neighbour_sum(e)) * grids[level + 1].unknown
    e += _prolong(_v_cycle(grids, inverse, coarse, level + 1), r.shape[-2:]) * grid.unknown
    e += grid.inverse * (r - _apply(grid, e))
    return e


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(a.flatten(2), b.flatten(2))[..., None, None]


def linear_imputation(images: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """``images`` ``(n, C, H, W)`` with the ``removed`` ``(n, H, W)`` pixels imputed linearly (no noise)."""
    if images.dim() != 4 or removed.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(
            f"`images` (n, C, H, W) and `removed` (n, H, W) must match; got {tuple(images.shape)} and "
            f"{tuple(removed.shape)}"
        )
    work = images if images.dtype in (torch.float32, torch.float64) else images.float()
    unknown = removed[:, None].to(work.dtype)
    if not unknown.any():
        return images.clone()
    if bool((unknown.flatten(1).amin(dim=1) > 0).any()):
        raise ValueError("every pixel of an image is removed: linear imputation needs at least one kept pixel")
    size = max(1, _SOLVE_ELEMENTS // work[0].numel())
    parts = [_impute(work[i : i + size], unknown[i : i + size]) for i in range(0, len(work), size)]
    return torch.cat(parts).to(images.dtype)


def _impute(work: torch.Tensor, unknown: torch.Tensor) -> torch.Tensor:
    """One solve: images ``(n, C, H, W)`` in float32 or float64 with their ``unknown`` ``(n, 1, H, W)`` imputed."""
    known = work * (1 - unknown)
    if not unknown.any():
        return known
    grids, inverse = _hierarchy(unknown)
    b = _neighbour_sum(known) * unknown
    tolerance = 1e-10 if work.dtype == torch.float64 else 1e-5
    return known + _solve(grids, inverse, b, tolerance)


def _solve(grids: list[_Grid], inverse: torch.Tensor, b: torch.Tensor, tolerance: float) -> torch.Tensor:
    """``x`` with ``K x = b`` to a relative residual of ``tolerance``: conjugate gradients, preconditioned by a V-cycle.

    An image leaves the batch as soon as all its channels have converged.
    """
    tiny = torch.finfo(b.dtype).tiny
    solution = torch.zeros_like(b)
    active = torch.arange(len(b), device=b.device)
    limit = tolerance**2 * _dot(b, b)
    x, r = torch.zeros_like(b), b.clone()
    z = _v_cycle(grids, inverse, r)
    p, rz = z.clone(), _dot(r, z)
    for _ in range(_MAX_ITERATIONS):
        done = (_dot(r, r) <= limit).flatten(1).all(dim=1)
        if bool(done.any()):
            solution[active[done]] = x[done]
            if bool(done.all()):
                return solution
            keep = ~done
            active, x, r, p, rz, limit, inverse = (t[keep] for t in (active, x, r, p, rz, limit, inverse))
            grids = [_Grid(*(t[keep] for t in grid)) for grid in grids]
        kp = _apply(grids[0], p)
        alpha = rz / _dot(p, kp).clamp(min=tiny)
        x.addcmul_(alpha, p)
        r.addcmul_(alpha, kp, value=-1)
        z = _v_cycle(grids, inverse, r)
        rz, previous = _dot(r, z), rz
        p = z.addcmul_(rz / previous.clamp(min=tiny), p)
    residual = float((_dot(r, r) / (limit / tolerance**2).clamp(min=tiny)).sqrt().max())
    warn(
        f"linear imputation did not converge in {_MAX_ITERATIONS} iterations (relative residual {residual:.1e}); "
        "the imputed values are approximate",
    )
    solution[active] = x
    return solution


def noisy_linear_imputation(
    images: torch.Tensor, removed: torch.Tensor, *, noise: float = 0.01, seeds: Sequence[int] | None = None
) -> torch.Tensor:
    """Linear imputation of the ``removed`` pixels plus Gaussian noise of standard deviation ``noise`` on them.

    Args:
        images: ``(n, C, H, W)``.
        removed: ``(n, H, W)`` boolean, the pixels to impute (all channels of a pixel together).
        noise: standard deviation of the noise added to each imputed value (ROAD uses 0.01).
        seeds: one seed per image for its noise (default ``0, 1, ...``), so that an image's noise does not depend
            on which others share its batch.

    Returns:
        ``(n, C, H, W)``: the kept pixels unchanged, the removed ones imputed.
    """
    imputed = linear_imputation(images, removed)
    if noise:
        seeds = range(len(images)) if seeds is None else seeds
        draws = [torch.randn(images.shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds]
        draw = torch.stack(draws).to(device=imputed.device, dtype=imputed.dtype)
        imputed = imputed + noise * draw * removed[:, None]
    return imputed
