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

    Args:
        dim: the projected size of every parameter's gradient.
        kind: ``"rademacher"`` or ``"gaussian"``.
        seed: the seed.

    Example:
        >>> import torch
        >>> projection = RandomProjection(8, seed=1)
        >>> g = torch.randn(3, 4, 5)                      # (batch, *parameter.shape)
        >>> projection("fc.weight", g).shape
        torch.Size([3, 8])
        >>> torch.equal(projection("fc.weight", g), RandomProjection(8, seed=1)("fc.weight", g))
        True
    """

    def __init__(self, dim: int, kind: str = "rademacher", seed: int = 0) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"`dim` must be a positive int; got {dim!r}")
        if kind not in ("rademacher", "gaussian"):
            raise ValueError(f"`kind` must be 'rademacher' or 'gaussian'; got {kind!r}")
        self.dim, self.kind, self.seed = dim, kind, int(seed)

    def blocks(self, name: str, size: int) -> Iterator[tuple[int, Tensor]]:
        """The matrix of parameter ``name`` for a gradient of ``size`` numbers: ``(first column, (dim, columns))``."""
        width = max(1, _BLOCK // self.dim)
        for block, start in enumerate(range(0, size, width)):
            generator = torch.Generator().manual_seed(_seed(self.seed, name, block))
            shape = (self.dim, min(width, size - start))
            if self.kind == "rademacher":
                values = torch.randint(0, 2, shape, generator=generator, dtype=torch.float32).mul_(2).sub_(1)
            else:
                values = torch.randn(shape, generator=generator, dtype=torch.float32)
            yield start, values.div_(math.sqrt(self.dim))

    def matrix(self, name: str, size: int) -> Tensor:
        """The whole ``(dim, size)`` matrix of parameter ``name`` (for tests and small parameters)."""
        return torch.cat([values for _, values in self.blocks(name, size)], dim=1)

    def __call__(self, name: str, gradients: Tensor) -> Tensor:
        """Project ``gradients (batch, *parameter.shape)`` of parameter ``name`` to ``(batch, dim)``."""
        flat = gradients.reshape(gradients.shape[0], -1)
        if self.dim > flat.shape[1]:
            raise ValueError(
                f"`dim`={self.dim} is larger than the gradient of {name!r} ({flat.shape[1]} numbers): a projection "
                f"cannot add information. Use dim <= {flat.shape[1]}, or leave that module out with `modules=`"
            )
        out = flat.new_zeros(flat.shape[0], self.dim)
        for start, values in self.blocks(name, flat.shape[1]):
            block = values.to(flat.device, flat.dtype)
            out.addmm_(flat[:, start : start + block.shape[1]], block.T)
        return out

    def __repr__(self) -> str:
        return f"RandomProjection(dim={self.dim}, kind={self.kind!r}, seed={self.seed})"
