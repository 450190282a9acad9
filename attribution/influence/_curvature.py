"""Curvature approximations of one module's parameter block: K-FAC, EK-FAC and the diagonal, as pure tensor math.

A block is a module's weight with its bias as the last input column: per example its gradient is the
``(d_out, d_in [+ 1])`` matrix ``G = sum_t delta_t a_t^T`` (``a`` the module's input with a 1 appended where it has a
bias, ``delta`` the gradient of the example's loss at the module's output, summed over positions ``t``). The Fisher
``E[vec(G) vec(G)^T]`` is approximated as:

- K-FAC: ``A (x) S`` with ``A`` the mean of ``a a^T`` over every position of every example and ``S`` the mean over
  examples of ``sum_t delta_t delta_t^T`` (for one position per example the usual ``E[a a^T]`` and
  ``E[delta delta^T]``); in the eigenbases ``A = Q_A diag(l_A) Q_A^T``, ``S = Q_S diag(l_S) Q_S^T`` its eigenvalues are
  ``l_S l_A^T``.
- EK-FAC (George et al. 2018): the same eigenbases, the eigenvalues refit as ``E[(Q_S^T G Q_A)^2]``.
- diagonal: ``E[G^2]`` in the parameters' own coordinates.

Preconditioning divides the rotated gradient by ``eigenvalues + damping``.
"""

from __future__ import annotations

import torch


def block_gradients(a: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-example block gradients ``(B, d_out, d_in)`` from inputs ``(B, T, d_in)`` and gradients ``(B, T, d_out)``."""
    return torch.einsum("bto,bti->boi", delta, a)


def with_bias_column(a: torch.Tensor) -> torch.Tensor:
    """``a`` with a column of ones appended on the last axis (the input that multiplies a bias)."""
    return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """``sum_n x_n x_n^T`` over every leading index of ``x`` (``(..., d)`` -> ``(d, d)``)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat.T @ flat


def eigenbasis(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0: round-off makes a covariance's smallest ones slightly negative) and eigenvectors.

    Decomposed in float64 whatever the factor's dtype (as Kronfluence does: a float32 ``eigh`` of a 2,049-wide factor
    moved scores by 5e-3), then cast back.
    """
    values, vectors = torch.linalg.eigh(((matrix + matrix.T) / 2).double())
    return values.clamp_min(0).to(matrix.dtype), vectors.to(matrix.dtype)


def rotate(g: torch.Tensor, q_s: torch.Tensor, q_a: torch.Tensor) -> torch.Tensor:
    """``Q_S^T G Q_A`` for each block gradient of ``g`` (``(..., d_out, d_in)``)."""
    return q_s.T @ g @ q_a


def unrotate(g: torch.Tensor, q_s: torch.Tensor, q_a: torch.Tensor) -> torch.Tensor:
    """``Q_S G Q_A^T``: the inverse of :func:`rotate`."""
    return q_s @ g @ q_a.T


def kfac_eigenvalues(values_s: torch.Tensor, values_a: torch.Tensor) -> torch.Tensor:
    """The eigenvalues ``l_S l_A^T`` of ``A (x) S``, laid out like a rotated block gradient ``(d_out, d_in)``."""
    return torch.outer(values_s, values_a)


def default_damping(eigenvalues: torch.Tensor) -> torch.Tensor:
    """0.1 times the mean eigenvalue (Kronfluence's heuristic), as a 0-d tensor."""
    return 0.1 * eigenvalues.mean()


def precondition_eigen(
    g: torch.Tensor, q_s: torch.Tensor, q_a: torch.Tensor, eigenvalues: torch.Tensor, damping: float | torch.Tensor
) -> torch.Tensor:
    """``(Q_A (x) Q_S) (Lambda + damping)^-1 (Q_A (x) Q_S)^T vec(G)`` for each block gradient of ``g``."""
    return unrotate(rotate(g, q_s, q_a) / (eigenvalues + damping), q_s, q_a)


def precondition_diagonal(g: torch.Tensor, diagonal: torch.Tensor, damping: float | torch.Tensor) -> torch.Tensor:
    """``G / (diag(F) + damping)`` elementwise."""
    return g / (diagonal + damping)
