"""The tensor math of infidelity and sensitivity: pure functions of tensors, tested without models.

Perturbed copies come in chunks of ``k`` copies of each of the ``B`` items, item-major (copy ``j`` of item ``i`` is
row ``i * k + j``, ``torch.repeat_interleave``'s order, captum's), so a chunk's ``(B * k,)`` values view as
``(B, k)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Norm = str | float


def chunk_sizes(n: int, batch: int, batch_size: int) -> list[int]:
    """How many copies of each item every chunk holds: ``k = min(n, max(batch_size // batch, 1))``, the rest last.

    Each chunk is one forward of ``batch * k`` rows, so ``n`` perturbations of ``batch`` items take
    ``ceil(n / k)`` forwards: ``ceil(n * batch / batch_size)`` when ``batch_size`` is a multiple of ``batch``
    (captum's ``max_examples_per_batch`` plan).

    Example:
        >>> chunk_sizes(10, 3, 12), chunk_sizes(10, 3, 2), chunk_sizes(4, 2, 100)
        ([4, 4, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [4])
    """
    per = min(n, max(batch_size // batch, 1))
    return [per] * (n // per) + ([n % per] if n % per else [])


def attribution_dots(attributions: Sequence[torch.Tensor], perturbations: Sequence[torch.Tensor]) -> torch.Tensor:
    """``I^T phi`` ``(B, k)``: each perturbation dotted with its item's attributions, summed over the input tensors.

    Args:
        attributions: per input tensor, ``(B, *shape)``.
        perturbations: per input tensor, ``(B * k, *shape)``, item-major.
    """
    total: torch.Tensor | None = None
    for phi, perturbation in zip(attributions, perturbations, strict=True):
        batch = phi.shape[0]
        per_item = perturbation.reshape(batch, -1, phi[0].numel())  # (B, k, features)
        dots = torch.einsum("bkf,bf->bk", per_item.to(phi.dtype), phi.reshape(batch, -1))
        total = dots if total is None else total + dots
    assert total is not None, "at least one input tensor"
    return total


def infidelity_sums(dots: torch.Tensor, differences: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, ...]:
    """Per item, the sums over a chunk's ``k`` copies that infidelity needs, ``(B,)`` each.

    Without ``normalize``: ``(sum (a - d)^2,)``; with it: ``(sum a^2, sum a d, sum d^2)``, with ``a = I^T phi``
    ``(B, k)`` and ``d = f(x) - f(x - I)`` ``(B, k)``. Sums of successive chunks add up.
    """
    if normalize:
        return (dots.square().sum(1), (dots * differences).sum(1), differences.square().sum(1))
    return ((dots - differences).square().sum(1),)


def infidelity_value(sums: Sequence[torch.Tensor], n: int, normalize: bool) -> torch.Tensor:
    """Infidelity ``(B,)`` from the sums over all ``n`` perturbations (see :func:`infidelity_sums`).

    Normalised, the attributions are scaled by ``beta = sum a d / sum a^2`` (1 where ``sum a^2`` is 0, as captum's
    ``safe_div``), the scale that minimises the squared error: ``(beta^2 sum a^2 - 2 beta sum a d + sum d^2) / n``.

    Example:
        >>> a, d = torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 4.0]])   # attributions off by a factor 2
        >>> infidelity_value(infidelity_sums(a, d, False), 2, False)
        tensor([2.5000])
        >>> infidelity_value(infidelity_sums(a, d, True), 2, True)  # beta = 2 makes them exact
        tensor([0.])
    """
    if not normalize:
        return sums[0] / n
    squares, products, differences = sums
    beta = products / torch.where(squares == 0, torch.ones_like(squares), squares)
    return (beta * beta * squares - 2 * beta * products + differences) / n


def flat_norms(rows: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The norm of each row of ``rows`` ``(..., F)`` over its last axis: ``"fro"`` is the 2-norm of the flat vector."""
    return torch.linalg.vector_norm(rows, ord=2 if norm == "fro" else float(norm), dim=-1)


def relative_changes(original: torch.Tensor, perturbed: torch.Tensor, norm: Norm) -> torch.Tensor:
    """``||phi(x + e) - phi(x)|| / ||phi(x)||`` ``(B, k)``, with ``||phi(x)|| = 0`` counted as 1 (captum's rule).

    Args:
        original: ``(B, F)`` each item's attributions, flattened (all input tensors concatenated).
        perturbed: ``(B, k, F)`` the attributions of ``k`` perturbed copies of each item.
        norm: ``"fro"`` (the 2-norm of the flattened attributions) or a vector norm's order ``p`` (1, 2, ``inf``).
    """
    scale = flat_norms(original, norm)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return flat_norms(perturbed - original[:, None], norm) / scale[:, None]


def check_norm(norm: object) -> Norm:
    """``norm`` checked: ``"fro"`` or a positive number (``math.inf`` for the largest absolute value)."""
    if norm == "fro":
        return "fro"
    if isinstance(norm, (int, float)) and not isinstance(norm, bool) and norm > 0:
        return float(norm)
    raise ValueError(
        f"`norm` must be 'fro' (the 2-norm of the flattened attributions, captum's default) or a positive vector "
        f"norm order such as 1, 2 or math.inf; got {norm!r}"
    )


def uniform_noise(
    parts: Sequence[torch.Tensor], k: int, radius: float, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """``k`` noisy copies of each item, item-major: ``x + (2 u - 1) radius``, ``u`` uniform in ``[0, 1)``.

    Copy by copy, each input tensor ``(B, ...)`` in turn draws ``u = torch.rand(x.shape, generator=generator)`` (in
    ``x``'s dtype, on its device); the copies are then interleaved so that copy ``j`` of item ``i`` is row
    ``i * k + j``. The ``m``-th copy of an item gets the same noise however the copies are split into chunks.
    """
    draws = [
        [torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) for x in parts] for _ in range(k)
    ]
    noisy = []
    for t, x in enumerate(parts):
        u = torch.stack([copy[t] for copy in draws], dim=1).flatten(0, 1)  # (B * k, ...), item-major
        noisy.append(x.repeat_interleave(k, dim=0) + (2 * u - 1) * radius)
    return tuple(noisy)
