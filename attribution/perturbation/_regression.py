"""The weighted linear regression KernelSHAP and LIME share, and their sample weights: pure functions of tensors."""

from __future__ import annotations

import math

import torch


def weighted_least_squares(
    design: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, *, intercept: bool = False
) -> torch.Tensor:
    """Per item, ``argmin_c sum_n w_n (y_n - X_n c)^2`` (minimum-norm where ``X`` is rank-deficient), in float64.

    Args:
        design: ``(n, d)``, the regressors of the samples (shared by the items).
        values: ``(batch, n)``, each item's values.
        weights: ``(n,)`` or ``(batch, n)``, non-negative.
        intercept: fit an intercept too; it is the last column of the result.

    Returns:
        ``(batch, d)``, or ``(batch, d + 1)`` with the intercept.

    Example:
        >>> X = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
        >>> weighted_least_squares(X, (X @ torch.tensor([2.0, -1.0]) + 0.5)[None], torch.ones(4), intercept=True)
        tensor([[ 2.0000, -1.0000,  0.5000]], dtype=torch.float64)
    """
    X = design.double()
    if intercept:
        X = torch.cat([X, X.new_ones(len(X), 1)], 1)
    root = weights.double().clamp(min=0).sqrt().expand(values.shape[0], -1)  # (batch, n)
    A = root[:, :, None] * X[None]
    b = (root * values.double())[:, :, None]
    return torch.linalg.lstsq(A, b, driver="gelsd").solution[:, :, 0]


def shapley_kernel(sizes: torch.Tensor, count: int) -> torch.Tensor:
    """Lundberg & Lee's kernel weight of coalitions of ``sizes`` (``0 < |z| < M``): ``(M-1) / (C(M,|z|) |z| (M-|z|))``.

    Example:
        >>> shapley_kernel(torch.tensor([1, 2, 3]), 4)
        tensor([0.2500, 0.1250, 0.2500], dtype=torch.float64)
    """
    z = sizes.double()
    binomial = torch.tensor([math.comb(count, int(s)) for s in sizes.tolist()], dtype=torch.float64)
    return (count - 1) / (binomial * z * (count - z))


def cosine_kernel(
    x: torch.Tensor, baseline: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, width: float
) -> torch.Tensor:
    """Captum's default LIME weights, ``exp(-d^2 / (2 width^2))``, ``d`` the cosine distance of ``x`` and each sample.

    A sample keeps the features where ``keep`` ``(n, M)`` is True and has the baseline elsewhere; the distance is
    taken in input space, item by item, from per-feature sums (no perturbed input is built). Returns ``(batch, n)``.

    Example:
        >>> x, ids = torch.tensor([[1.0, 2.0]]), torch.tensor([0, 1])
        >>> cosine_kernel(x, torch.zeros_like(x), ids, torch.tensor([[True, True], [True, False]]), 1.0)
        tensor([[1.0000, 0.8583]], dtype=torch.float64)
    """
    flat_ids = ids.flatten().to(x.device)
    count = keep.shape[1]

    def per_feature(values: torch.Tensor) -> torch.Tensor:  # (batch, M) sums over each feature's elements
        return values.new_zeros(len(values), count).index_add_(1, flat_ids, values)

    xx, bb = x.double().flatten(1), baseline.double().flatten(1)
    own, mixed, base = per_feature(xx * xx), per_feature(xx * bb), per_feature(bb * bb)
    k = keep.double().to(x.device)
    dot = own @ k.T + mixed @ (1 - k).T  # (batch, n)
    sample_norm = (own @ k.T + base @ (1 - k).T).clamp(min=0).sqrt()
    norm = own.sum(1, keepdim=True).sqrt()
    cosine = dot / (norm.clamp(min=1e-8) * sample_norm.clamp(min=1e-8))
    return torch.exp(-((1 - cosine) ** 2) / (2 * width**2))


def binary_cosine_kernel(keep: torch.Tensor, width: float) -> torch.Tensor:
    """The LIME weights ``(n,)`` in the space of the binary features (token ids): samples against all ones.

    Example:
        >>> binary_cosine_kernel(torch.tensor([[True, True], [False, False]]), 1.0)
        tensor([1.0000, 0.6065], dtype=torch.float64)
    """
    on = keep.double().sum(1)
    cosine = on / (math.sqrt(keep.shape[1]) * on.sqrt()).clamp(min=1e-8)
    return torch.exp(-((1 - cosine) ** 2) / (2 * width**2))
