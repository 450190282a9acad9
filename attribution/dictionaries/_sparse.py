"""Sparse codes for TopK and BatchTopK training: the decoder and every backward touch only the active features.

A batch's active features are held as a :class:`Pattern` in compressed rows (row ``r``'s entries are
``cols[offsets[r]:offsets[r + 1]]``). The pre-activations are computed densely (the one ``rows x d_in x n_features``
product of a step) under ``no_grad``; :func:`gathered` takes the active ones with a backward that reaches ``W_enc``,
``b_enc`` and the encoder's input through the active entries only, and :func:`decode` is ``torch.nn.functional
.embedding_bag``, whose forward and backward (to the values and to ``W_dec``) are sparse too. Dense, the same step
costs five more products of that size (the decoder, its two gradients, the encoder's two gradients).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class Pattern(NamedTuple):
    """Which features are active in each row: ``cols[offsets[r]:offsets[r + 1]]`` are row ``r``'s.

    ``rows (nnz,)`` and ``cols (nnz,)`` (int64) name each entry, sorted by row; ``offsets (rows,)`` is where each row
    starts; ``n_features`` the dictionary's width.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    offsets: torch.Tensor
    n_features: int


def _row_major(flat: torch.Tensor, shape: tuple[int, int]) -> Pattern:
    """The pattern of the flat indices ``flat`` (``row * n_features + col``, any order) into ``shape``."""
    flat = flat.sort().values
    rows, cols = flat // shape[1], flat % shape[1]
    counts = torch.bincount(rows, minlength=shape[0])
    return Pattern(rows, cols, torch.cumsum(counts, 0) - counts, shape[1])


def topk_pattern(pre: torch.Tensor, k: int) -> Pattern:
    """The ``k`` largest of ``pre (rows, n)`` per row: the entries of :func:`~._math.topk`, which keeps them ReLU'd.

    The ``k`` largest of ``pre`` are the ``k`` largest of ``relu(pre)`` but where a row has fewer than ``k``
    positive entries; the entries taken then differ, not their ReLU'd values (zero), nor any gradient.

    Example:
        >>> topk_pattern(torch.tensor([[3.0, -1.0, 2.0], [0.0, 5.0, 1.0]]), 1).cols
        tensor([0, 1])
    """
    n, width = pre.shape
    k = min(k, width)
    cols = pre.topk(k, dim=-1, sorted=False).indices.reshape(-1)  # no ReLU pass over (rows, n): see above
    rows = torch.arange(n, device=pre.device).repeat_interleave(k)
    return Pattern(rows, cols, torch.arange(n, device=pre.device) * k, width)


def batch_topk_pattern(pre: torch.Tensor, k: int) -> Pattern:
    """The ``k x rows`` largest of ``pre`` in the batch, those :func:`~._math.batch_topk` keeps (see topk_pattern).

    Example:
        >>> p = batch_topk_pattern(torch.tensor([[3.0, 2.0], [0.5, 1.0]]), 1)
        >>> p.rows, p.cols, p.offsets
        (tensor([0, 0]), tensor([0, 1]), tensor([0, 2]))
    """
    flat = pre.reshape(-1)
    keep = min(k * pre.shape[0], flat.numel())
    return _row_major(flat.topk(keep, sorted=False).indices, (pre.shape[0], pre.shape[1]))


def at_least_pattern(pre: torch.Tensor, kth: torch.Tensor) -> Pattern:
    """The entries with ``relu(pre) >= kth``: BatchTopK over several processes, ``kth`` the whole batch's cut."""
    flat = (torch.relu(pre) >= kth).reshape(-1).nonzero().squeeze(-1)
    return _row_major(flat, (pre.shape[0], pre.shape[1]))


def dead_topk_pattern(pre: torch.Tensor, dead: torch.Tensor, k: int) -> Pattern:
    """The ``min(k, dead features)`` largest of ``pre`` among the ``dead`` features per row (AuxK's inputs).

    The values it selects are those of :func:`~._math.auxiliary_topk`; where that one takes a zero of a live
    feature (a row with fewer positive dead pre-activations than ``k``), this one takes a zero of a dead one.

    Example:
        >>> dead_topk_pattern(torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([False, True, True]), 1).cols
        tensor([2])
    """
    columns = dead.nonzero().squeeze(-1)
    inner = topk_pattern(pre[:, columns], min(k, len(columns)))
    return inner._replace(cols=columns[inner.cols], n_features=pre.shape[1])


def _by_feature(pattern: Pattern) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries' order sorted by feature, and where each feature's entries start in it (the transposed pattern)."""
    order = pattern.cols.argsort(stable=True)
    counts = torch.bincount(pattern.cols, minlength=pattern.n_features)
    return order, torch.cumsum(counts, 0) - counts


class _Gathered(torch.autograd.Function):
    """``pre[rows, cols]`` of pre-activations computed without a graph, with the backward of ``x @ W_enc + b_enc``."""

    @staticmethod
    def forward(
        ctx: Any,
        pre: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, rows, cols, offsets)
        return pre[rows, cols]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, rows, cols, offsets = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # row r: sum over its entries of grad * W_enc[:, col]
            grad_x = F.embedding_bag(cols, weight.T.contiguous(), offsets, mode="sum", per_sample_weights=grad)
        if ctx.needs_input_grad[2]:  # column c of W_enc: sum over its entries of grad * x[row]
            order, starts = _by_feature(Pattern(rows, cols, offsets, weight.shape[1]))
            grad_weight = F.embedding_bag(rows[order], x, starts, mode="sum", per_sample_weights=grad[order]).T
        if ctx.needs_input_grad[3]:
            grad_bias = torch.zeros(weight.shape[1], dtype=grad.dtype, device=grad.device).index_add_(0, cols, grad)
        return None, grad_x, grad_weight, grad_bias, None, None, None


def gathered(
    pre: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pattern: Pattern
) -> torch.Tensor:
    """The active pre-activations ``pre[rows, cols]`` ``(nnz,)``, differentiable as ``(x @ weight + bias)[rows, cols]``.

    Args:
        pre: ``x @ weight + bias`` ``(rows, n_features)``, computed without autograd (its values are returned).
        x: the encoder's input ``(rows, d_in)``.
        weight: ``W_enc (d_in, n_features)``.
        bias: ``b_enc (n_features,)``.
        pattern: the active entries.

    Returns:
        ``(nnz,)``; its backward costs ``O(nnz x d_in)`` (two ``embedding_bag`` calls and an ``index_add``).

    Example:
        >>> x, w, b = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True), torch.zeros(4)
        >>> p = topk_pattern(x @ w.detach(), 2)
        >>> v = gathered((x @ w + b).detach(), x, w, b, p)
        >>> v.sum().backward()
        >>> int((w.grad != 0).any(0).sum()) <= 4, v.shape
        (True, torch.Size([4]))
    """
    return _Gathered.apply(pre, x, weight, bias, pattern.rows, pattern.cols, pattern.offsets)


def decode(values: torch.Tensor, pattern: Pattern, weight: torch.Tensor) -> torch.Tensor:
    """``sum over row r's entries of values * W_dec[col]``: ``(rows, d_out)``, without the bias.

    ``torch.nn.functional.embedding_bag`` in ``"sum"`` mode with ``values`` as per-sample weights: ``O(nnz x
    d_out)`` forward and backward (the gradient to ``values`` is each entry's row of ``W_dec`` dotted with the output's
    gradient; to ``W_dec`` the output's gradient scattered to the active rows), where ``f @ W_dec`` costs ``O(rows x
    n_features x d_out)``.

    Example:
        >>> w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        >>> one_row = Pattern(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([0]), 3)
        >>> decode(torch.tensor([2.0, 3.0]), one_row, w)  # 2 * w[1] + 3 * w[2]
        tensor([[3., 5.]])
    """
    return F.embedding_bag(pattern.cols, weight, pattern.offsets, mode="sum", per_sample_weights=values)


def fired(values: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """Which features have a positive value in some row: ``(n_features,)`` bool."""
    out = torch.zeros(pattern.n_features, dtype=torch.bool, device=values.device)
    return out.index_fill_(0, pattern.cols[values > 0], True)
