"""Interventions: modules that mix a base and a source activation along their last axis (pyvene's formulas).

Each takes ``base`` and ``source`` shaped ``(..., dim)`` and returns the intervened ``(..., dim)``. ``R`` is an
orthogonal ``(dim, dim)`` matrix acting on column vectors: the rotated coordinates of ``b`` are ``R b`` (pyvene keeps
``W = R^T`` and writes ``b @ W``; the two are the same map).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrizations


def _check_dims(dim: int, k: int) -> None:
    """Raise unless ``0 <= k <= dim`` and ``dim >= 1``."""
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"`dim` must be a positive int (the site's width); got {dim!r}")
    if not isinstance(k, int) or not 0 <= k <= dim:
        raise ValueError(f"`k` must be an int in [0, dim={dim}]; got {k!r}: choose a subspace no wider than the site")


def _check_pair(base: torch.Tensor, source: torch.Tensor, dim: int) -> None:
    """Raise unless ``base`` and ``source`` have the same shape and last axis ``dim``."""
    if base.shape != source.shape:
        raise ValueError(
            f"`source` must have the base's shape {tuple(base.shape)} at the site; got {tuple(source.shape)}"
        )
    if base.shape[-1] != dim:
        raise ValueError(
            f"the site's width is {base.shape[-1]}, but the intervention was built with dim={dim}: "
            f"build it with dim={base.shape[-1]}"
        )


def swap_first(rotated_base: torch.Tensor, rotated_source: torch.Tensor, k: int) -> torch.Tensor:
    """``rotated_base`` with its first ``k`` coordinates (last axis) taken from ``rotated_source``."""
    return torch.cat([rotated_source[..., :k], rotated_base[..., k:]], dim=-1)


def sigmoid_mask(dim: int, low: torch.Tensor, high: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The boundary mask of pyvene, ``sigmoid((i - low) / T) * sigmoid((high - i) / T)`` for ``i = 0 .. dim - 1``."""
    i = torch.arange(dim, dtype=high.dtype, device=high.device)
    return torch.sigmoid((i - low) / temperature) * torch.sigmoid((high - i) / temperature)


class Interchange(nn.Module):
    """The plain swap: the source's values replace the base's (what activation patching does); no parameters.

    Example:
        >>> Interchange()(torch.zeros(1, 2), torch.ones(1, 2))
        tensor([[1., 1.]])
    """

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``source``, after checking it is shaped like ``base``."""
        _check_pair(base, source, base.shape[-1])
        return source


class _Rotated(nn.Module):
    """Holds an orthogonal ``R`` (``rows x dim``, orthonormal rows) kept orthogonal by a parametrisation."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.dim = dim
        linear = nn.Linear(dim, rows, bias=False)  # weight (rows, dim): R, acting on column vectors
        self.rotate = parametrizations.orthogonal(linear)

    @property
    def rotation(self) -> torch.Tensor:
        """``R``: ``(rows, dim)`` with orthonormal rows; assign any such matrix (orthogonal within 1e-5)."""
        return cast(torch.Tensor, self.rotate.weight)

    @rotation.setter
    def rotation(self, value: torch.Tensor) -> None:
        expected = tuple(self.rotation.shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"`rotation` must be a tensor of shape {expected} with orthonormal rows; got {got}")
        eye = torch.eye(expected[0], dtype=value.dtype, device=value.device)
        if not torch.allclose(value @ value.T, eye, atol=1e-5):
            raise ValueError(
                "`rotation` must have orthonormal rows (R @ R.T == I within 1e-5); got a matrix that does not"
            )
        with torch.no_grad():
            self.rotate.weight = value.to(self.rotation.dtype)

    def _rotated(self, base: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``R``, ``R b`` and ``R s`` (row-vector form: ``x @ R.T``), after the shape checks."""
        _check_pair(base, source, self.dim)
        r = self.rotation.to(base.dtype)
        return r, base @ r.T, source @ r.T


class RotatedSubspace(_Rotated):
    """Distributed alignment search's intervention: ``R^T swap_k(R b, R s)`` (pyvene's RotatedSpaceIntervention).

    Geiger et al., "Finding Alignments Between Interpretable Causal Variables and Distributed Neural
    Representations" (https://arxiv.org/abs/2303.02536).

    Args:
        dim: the site's width (the last axis of the intervened activation).
        k: how many rotated coordinates come from the source (``0 <= k <= dim``).

    Example:
        >>> iv = RotatedSubspace(3, 1)
        >>> iv.rotation = torch.eye(3)
        >>> iv(torch.zeros(1, 3), torch.ones(1, 3))
        tensor([[1., 0., 0.]], grad_fn=<MmBackward0>)
    """

    def __init__(self, dim: int, k: int) -> None:
        _check_dims(dim, k)
        super().__init__(dim, dim)
        self.k = k

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The intervened activation, shaped like ``base`` ``(..., dim)``."""
        r, rb, rs = self._rotated(base, source)
        return swap_first(rb, rs, self.k) @ r


class LowRankSubspace(_Rotated):
    """A rank-``k`` interchange: ``b + (R_k s - R_k b) R_k`` (pyvene's LowRankRotatedSpaceIntervention).

    ``R_k`` (``.rotation``) is ``(k, dim)`` with orthonormal rows: only ``k * dim`` parameters.

    Args:
        dim: the site's width.
        k: the subspace's dimension (``1 <= k <= dim``).

    Example:
        >>> iv = LowRankSubspace(3, 1)
        >>> iv.rotation = torch.tensor([[0.0, 1.0, 0.0]])
        >>> iv(torch.zeros(1, 3), torch.ones(1, 3))
        tensor([[0., 1., 0.]], grad_fn=<AddBackward0>)
    """

    def __init__(self, dim: int, k: int) -> None:
        _check_dims(dim, k)
        if k < 1:
            raise ValueError("`k` must be at least 1 for LowRankSubspace; got 0 (an empty subspace changes nothing)")
        super().__init__(dim, k)
        self.k = k

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The intervened activation, shaped like ``base`` ``(..., dim)``."""
        r, rb, rs = self._rotated(base, source)
        return base + (rs - rb) @ r


class BoundlessSubspace(_Rotated):
    """Boundless DAS: a learned soft boundary over the rotated coordinates (pyvene's BoundlessRotatedSpaceIntervention).

    Output ``R^T ((1 - m) * R b + m * R s)`` with mask ``m_i = sigmoid((i - b_low)/T) * sigmoid((b_high - i)/T)``,
    ``b_low = 0``, ``b_high = beta * dim``, ``beta`` learned and clamped to ``[1e-3, 1]`` as pyvene does, and ``T``
    (``.temperature``, not learned) annealed by the trainer. Wu et al., "Interpretability at Scale"
    (https://arxiv.org/abs/2305.08809).

    Args:
        dim: the site's width.
        temperature: the starting temperature (pyvene's default 50).

    Example:
        >>> iv = BoundlessSubspace(4)
        >>> iv(torch.zeros(2, 4), torch.zeros(2, 4)).shape
        torch.Size([2, 4])
    """

    temperature: torch.Tensor

    def __init__(self, dim: int, temperature: float = 50.0) -> None:
        _check_dims(dim, 0)
        super().__init__(dim, dim)
        self.beta = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("temperature", torch.tensor(float(temperature)))

    def mask(self) -> torch.Tensor:
        """The current soft mask over the rotated coordinates, ``(dim,)``."""
        beta = torch.clamp(self.beta, 1e-3, 1.0)
        zero = torch.zeros((), dtype=beta.dtype, device=beta.device)
        return sigmoid_mask(self.dim, zero, beta * self.dim, self.temperature.to(beta.dtype))

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The intervened activation, shaped like ``base`` ``(..., dim)``."""
        r, rb, rs = self._rotated(base, source)
        m = self.mask().to(base.dtype)
        return ((1.0 - m) * rb + m * rs) @ r
