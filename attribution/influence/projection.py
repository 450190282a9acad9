"""Seeded random projections of per-parameter gradients (Johnson-Lindenstrauss), the same in every process."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

_BLOCK = 1 << 22  # elements of the projection matrix drawn at a time


def _seed(seed: int, name: str, block: int) -> int:
    """A generator seed from the projection's seed, the parameter name and the block: a stable hash, not ``hash()``."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class RandomProjection:
    """Project each parameter's flattened gradient to ``dim`` numbers with a seeded random matrix.

    The matrix of a parameter has i.i.d. entries ``+-1`` (``"rademacher"``) or standard normal (``"gaussian"``),
    scaled by ``1 / sqrt(dim)``, so that inner products of projected gradients equal those of the gradients in
    expectation, within the Johnson-Lindenstrauss error ``O(sqrt(1 / dim))`` relative to the norms. It is drawn on
    the CPU, block by block of columns (at most 4M entries at a time, so memory stays bounded), from generators
    seeded with a stable hash of ``seed``, the parameter's name and the block: every process and every call draws
    the same matrix for the same name, ``dim`` and gradient size.

    ``structured=True`` (``dim`` a square ``k * k``) projects a matrix parameter's gradient ``G (rows, cols)`` to
    ``P_rows G P_cols^T`` with two seeded ``(k, rows)`` and ``(k, cols)`` matrices of entries ``+-1 / sqrt(k)`` (or
    normal), LoGra's Kronecker form: inner products are again kept in expectation, and a linear layer's projected
    gradient ``sum_t (P_out delta_t)(P_in a_t)^T`` is computed from its input and output gradient without forming the
    per-example ``(out, in)`` gradient (:func:`per_example_gradients` does so for ``nn.Linear`` and HF ``Conv1D``),
    so per-example gradients of sequences take far less memory. Other parameters (vectors, convolution kernels, a
    matrix with fewer than ``k`` rows or columns) get the dense projection.

    Args:
        dim: the projected size of every parameter's gradient.
        kind: ``"rademacher"`` or ``"gaussian"``.
        seed: the seed.
        structured: the Kronecker form for matrix parameters (``dim`` must be a square).

    Example:
        >>> import torch
        >>> projection = RandomProjection(8, seed=1)
        >>> g = torch.randn(3, 4, 5)                      # (batch, *parameter.shape)
        >>> projection("fc.weight", g).shape
        torch.Size([3, 8])
        >>> torch.equal(projection("fc.weight", g), RandomProjection(8, seed=1)("fc.weight", g))
        True
    """

    def __init__(self, dim: int, kind: str = "rademacher", seed: int = 0, structured: bool = False) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"`dim` must be a positive int; got {dim!r}")
        if kind not in ("rademacher", "gaussian"):
            raise ValueError(f"`kind` must be 'rademacher' or 'gaussian'; got {kind!r}")
        self.side = math.isqrt(dim)
        if structured and self.side**2 != dim:
            near = ", ".join(str(k * k) for k in (self.side, self.side + 1) if k)
            raise ValueError(
                f"a structured projection maps a matrix gradient to k x k numbers, so `dim` must be a square; got "
                f"{dim}. Use {near} (or structured=False)"
            )
        self.dim, self.kind, self.seed, self.structured = dim, kind, int(seed), bool(structured)

    def _draw(self, shape: tuple[int, int], seed: int, scale: int) -> Tensor:
        generator = torch.Generator().manual_seed(seed)
        if self.kind == "rademacher":
            values = torch.randint(0, 2, shape, generator=generator, dtype=torch.float32).mul_(2).sub_(1)
        else:
            values = torch.randn(shape, generator=generator, dtype=torch.float32)
        return values.div_(math.sqrt(scale))

    def blocks(self, name: str, size: int) -> Iterator[tuple[int, Tensor]]:
        """The matrix of parameter ``name`` for a gradient of ``size`` numbers: ``(first column, (dim, columns))``."""
        width = max(1, _BLOCK // self.dim)
        for block, start in enumerate(range(0, size, width)):
            yield start, self._draw((self.dim, min(width, size - start)), _seed(self.seed, name, block), self.dim)

    def factors(self, name: str, rows: int, cols: int) -> tuple[Tensor, Tensor] | None:
        """The structured form's ``(k, rows)`` and ``(k, cols)`` matrices of a matrix parameter ``name``.

        ``None`` where that parameter gets the dense projection: not structured, or fewer than ``k`` rows or columns.
        """
        if not self.structured or rows < self.side or cols < self.side:
            return None
        left = self._draw((self.side, rows), _seed(self.seed, f"{name}/rows", 0), self.side)
        return left, self._draw((self.side, cols), _seed(self.seed, f"{name}/cols", 0), self.side)

    def outer(self, name: str, left: Tensor, right: Tensor, rows: int | None = None) -> Tensor:
        """Project ``sum_t left_t right_t^T`` per example (``left (batch, T, rows)``, ``right (batch, T, cols)``).

        The structured form never forms the ``(batch, rows, cols)`` sum: ``(P_rows left)^T (P_cols right)`` summed
        over ``t``. Equal to ``self(name, left^T right)`` (the dense projection where that parameter gets it).
        ``left`` may be integer ids ``(batch, T)`` standing for one-hot rows of a ``rows``-row matrix (an embedding).
        """
        one_hot = not left.is_floating_point()
        if one_hot and rows is None:
            raise ValueError("`rows` is needed where `left` holds ids (one-hot rows)")
        height = int(rows) if one_hot else left.shape[-1]  # type: ignore[arg-type]
        pair = self.factors(name, height, right.shape[-1])
        if pair is None:
            if one_hot:
                left = torch.nn.functional.one_hot(left, height).to(right.dtype)
            return self(name, torch.bmm(left.transpose(1, 2), right))
        p_rows, p_cols = (m.to(right.device, right.dtype) for m in pair)
        projected = p_rows.T[left] if one_hot else left @ p_rows.T  # (batch, T, k)
        return torch.bmm(projected.transpose(1, 2), right @ p_cols.T).reshape(right.shape[0], self.dim)

    def matrix(self, name: str, size: int) -> Tensor:
        """The whole ``(dim, size)`` matrix of parameter ``name`` (for tests and small parameters)."""
        return torch.cat([values for _, values in self.blocks(name, size)], dim=1)

    def check(self, name: str, size: int) -> None:
        """Raise where a parameter's gradient (``size`` numbers) is smaller than ``dim``."""
        if self.dim > size:
            raise ValueError(
                f"`dim`={self.dim} is larger than the gradient of {name!r} ({size} numbers): a projection "
                f"cannot add information. Use dim <= {size}, or leave that module out with `modules=`"
            )

    def __call__(self, name: str, gradients: Tensor) -> Tensor:
        """Project ``gradients (batch, *parameter.shape)`` of parameter ``name`` to ``(batch, dim)``."""
        flat = gradients.reshape(gradients.shape[0], -1)
        self.check(name, flat.shape[1])
        pair = self.factors(name, *gradients.shape[1:]) if gradients.ndim == 3 else None
        if pair is not None:  # the structured form of a matrix parameter: P_rows G P_cols^T
            p_rows, p_cols = (m.to(gradients.device, gradients.dtype) for m in pair)
            return (p_rows @ gradients @ p_cols.T).reshape(gradients.shape[0], self.dim)
        out = flat.new_zeros(flat.shape[0], self.dim)
        for start, values in self.blocks(name, flat.shape[1]):
            block = values.to(flat.device, flat.dtype)
            out.addmm_(flat[:, start : start + block.shape[1]], block.T)
        return out

    def __repr__(self) -> str:
        structured = ", structured=True" if self.structured else ""
        return f"RandomProjection(dim={self.dim}, kind={self.kind!r}, seed={self.seed}{structured})"
