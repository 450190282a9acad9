"""TCAV's scores of directional derivatives: pure tensor math.

``derivatives (items, k)``: the target's gradient at a layer (flattened) dotted with ``k`` CAVs, one column each.
"""

from __future__ import annotations

import torch


def sign_count(derivatives: torch.Tensor) -> torch.Tensor:
    """``(k,)``: the share of items whose directional derivative is positive (Kim et al.'s TCAV score).

    Example:
        >>> sign_count(torch.tensor([[1.0, -2.0], [-1.0, -3.0], [2.0, 0.0], [0.5, 1.0]]))
        tensor([0.7500, 0.2500], dtype=torch.float64)
    """
    return (derivatives > 0).double().mean(0)


def magnitude(derivatives: torch.Tensor) -> torch.Tensor:
    """``(k,)``: ``sum_x max(d_x, 0) / sum_x |d_x|``, the positive derivatives' share of all (0 when all are 0).

    Example:
        >>> magnitude(torch.tensor([[1.0, -2.0], [-1.0, -3.0], [2.0, 0.0], [0.5, 1.0]]))
        tensor([0.7778, 0.1667], dtype=torch.float64)
    """
    d = derivatives.double()
    total = d.abs().sum(0)
    return torch.where(total > 0, d.clamp(min=0).sum(0) / torch.where(total > 0, total, 1.0), 0.0)


def bonferroni(p: float, tests: int) -> float:
    """``min(1, tests * p)`` (``nan`` stays ``nan``).

    Example:
        >>> bonferroni(0.004, 6), bonferroni(0.3, 6)
        (0.024, 1.0)
    """
    return min(1.0, p * tests) if p == p else p
