"""Arnoldi iteration on a Hessian-vector product, and the top eigenpairs it finds (Schioppa et al. 2022).

``arnoldi`` builds an orthonormal basis ``Q`` of the Krylov space ``span(b, A b, ..., A^{m-1} b)`` of a symmetric
matrix ``A`` known only through ``v -> A v``, with ``T = Q^T A Q`` (Trefethen & Bau, lectures 33-34). The top
eigenpairs of ``T``, mapped back by ``Q``, approximate those of ``A`` (the extreme ones converge first); when the
space closes (the next direction is numerically in it) it is invariant and its eigenpairs are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


def check_dimensions(arnoldi_dim: int, projection_dim: int) -> None:
    """Refuse dimensions that are not positive integers, or more eigenpairs kept than the Krylov space has."""
    for name, value in (("arnoldi_dim", arnoldi_dim), ("projection_dim", projection_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer; got {value!r}")
    if projection_dim > arnoldi_dim:
        raise ValueError(
            f"`projection_dim` ({projection_dim}) must be at most `arnoldi_dim` ({arnoldi_dim}): the kept eigenpairs "
            f"are found in the {arnoldi_dim}-dimensional Krylov space. Raise `arnoldi_dim` (e.g. to "
            f"{4 * projection_dim}) or lower `projection_dim`"
        )


Progress = tuple[Tensor, Tensor, int]
"""An unfinished iteration: the basis rows so far, ``T`` so far and the number of steps done."""


def arnoldi(
    hvp: Callable[[Tensor], Tensor],
    start: Tensor,
    steps: int,
    tol: float | None = None,
    loop: Callable[[Iterable[int]], Iterable[int]] = iter,
    resume: Progress | None = None,
    after_step: Callable[[Progress], None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Orthonormal Krylov basis ``Q`` ``(n, m)`` and ``T = Q^T A Q`` ``(m, m)``, ``m <= steps`` products ``A q``.

    Gram-Schmidt is run twice per step ("twice is enough": the basis stays orthonormal to round-off). The iteration
    stops early when the new direction's norm is below ``tol`` (default: the square root of the dtype's epsilon)
    times that of ``A q``: the space is then invariant. ``loop`` wraps the steps (a progress bar). ``after_step``
    gets the progress after every step that leaves more to do; ``resume`` continues from such a progress, to the
    same result bitwise (each step depends only on the rows and ``T`` before it).
    """
    if tol is None:
        tol = torch.finfo(start.dtype).eps ** 0.5
    if resume is not None:
        rows, restricted, done = resume[0].clone(), resume[1].clone(), resume[2]
    else:
        rows = start.new_zeros(steps, len(start))  # the basis vectors, one per row
        rows[0] = start / torch.linalg.vector_norm(start)
        restricted = start.new_zeros(steps + 1, steps)  # T, with T[k + 1, k] = |residual of step k|
        done = 0
    m = steps
    for k in loop(range(done, steps)):
        product = hvp(rows[k])
        q = rows[: k + 1]
        first = q @ product
        residual = product - q.T @ first
        second = q @ residual
        residual = residual - q.T @ second
        norm = torch.linalg.vector_norm(residual)
        restricted[: k + 1, k], restricted[k + 1, k] = first + second, norm
        if k + 1 == steps or norm <= tol * torch.linalg.vector_norm(product):
            m = k + 1
            break
        rows[k + 1] = residual / norm
        if after_step is not None:
            after_step((rows, restricted, k + 1))
    return rows[:m].T, restricted[:m, :m]


def top_eigenpairs(basis: Tensor, restricted: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest eigenvalues of ``T`` (descending) and their eigenvectors ``Q v`` ``(n, k)``.

    ``T`` is symmetrised first (it is ``Q^T A Q`` of a symmetric ``A`` up to round-off). Fewer than ``k`` come back
    when the Krylov space is smaller.
    """
    values, coordinates = torch.linalg.eigh((restricted + restricted.T) / 2)
    keep = min(k, len(values))
    return values.flip(0)[:keep], basis @ coordinates.flip(1)[:, :keep]
