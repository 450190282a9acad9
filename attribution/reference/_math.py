"""Reference-based attribution arithmetic: pure functions of tensors, no model.

The DeepLIFT rules (Shrikumar et al., 2017, https://arxiv.org/abs/1704.02685) give each nonlinearity a multiplier
``m = dy / dx`` (differences from the reference) in place of its derivative; these functions compute them from the
forward's tensors, the input half ``x`` and the reference half ``r`` of one concatenated batch.
"""

from __future__ import annotations

import torch

EPS = 1e-10
"""Below this ``|x - r|`` the Rescale rule falls back to the gradient (captum's ``eps``)."""


def rescale(x: torch.Tensor, r: torch.Tensor, y: torch.Tensor, y_r: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The Rescale multiplier ``(y - y_r) / (x - r)`` of an elementwise ``y = f(x)``; 0 where ``|x - r| < eps``.

    Where ``|x - r| < eps`` the caller uses the gradient ``f'(x)`` instead (see :func:`fallback`).

    Example:
        >>> x, r = torch.tensor([2.0, -1.0, 3.0]), torch.tensor([0.0, 1.0, 3.0])
        >>> rescale(x, r, torch.relu(x), torch.relu(r))
        tensor([1.0000, 0.5000, 0.0000])
    """
    dx = x - r
    far = dx.abs() >= eps
    return torch.where(far, (y - y_r) / torch.where(far, dx, 1.0), 0.0)


def fallback(x: torch.Tensor, r: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Where the Rescale rule takes the gradient instead: ``|x - r| < eps`` (a boolean tensor).

    Example:
        >>> fallback(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
        tensor([ True, False])
    """
    return (x - r).abs() < eps


def centred(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """``grad`` minus its mean along ``dim``: the softmax rule's normalisation, per item and position.

    Example:
        >>> centred(torch.tensor([[1.0, 3.0]]), dim=1)
        tensor([[-1.,  1.]])
    """
    return grad - grad.mean(dim=dim, keepdim=True)


def cross_max_shares(y: torch.Tensor, y_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The max-pool split (captum's) of ``y - y_r``: ``max(y, y_r) - y_r`` (at ``x``'s winners) and ``y - max(y, y_r)``.

    The first share goes back to the positions where the input's window has its maximum, the second (0 or negative)
    to the reference's; together they are ``y - y_r``.

    Example:
        >>> cross_max_shares(torch.tensor([3.0, 1.0]), torch.tensor([1.0, 2.0]))
        (tensor([2., 0.]), tensor([ 0., -1.]))
    """
    top = torch.maximum(y, y_r)
    return top - y_r, y - top


def average_rule(
    a: torch.Tensor, a_r: torch.Tensor, b: torch.Tensor, b_r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multipliers of a product ``a * b`` under the average (Shapley) rule: ``(b + b_r) / 2`` and ``(a + a_r) / 2``.

    They split ``a b - a_r b_r`` exactly: ``(a - a_r) (b + b_r) / 2 + (b - b_r) (a + a_r) / 2``.

    Example:
        >>> m_a, m_b = average_rule(torch.tensor(3.0), torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.0))
        >>> float((3.0 - 1.0) * m_a + (2.0 - 0.0) * m_b), 3.0 * 2.0 - 1.0 * 0.0
        (6.0, 6.0)
    """
    return (b + b_r) / 2, (a + a_r) / 2


def mean_over_references(values: torch.Tensor, batch: int) -> torch.Tensor:
    """``(batch * n, ...)`` values, item-major (``n`` references per item), averaged to ``(batch, ...)``.

    Example:
        >>> mean_over_references(torch.tensor([1.0, 3.0, 10.0, 20.0]), 2)
        tensor([ 2., 15.])
    """
    return values.view(batch, -1, *values.shape[1:]).mean(dim=1)
