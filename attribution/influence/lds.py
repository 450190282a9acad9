"""Linear datamodeling score (Park et al. 2023, TRAK; dattri's definition) and the retraining helper it needs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _ranks(values: Tensor) -> Tensor:
    """Average ranks (ties share their mean rank) along the last dimension, as scipy's ``rankdata``."""
    order = values.argsort(dim=-1)
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks.scatter_(-1, order, torch.arange(values.shape[-1], dtype=torch.float64).expand_as(ranks).contiguous())
    out = torch.empty_like(ranks)
    for row in range(values.shape[0]):
        _, inverse = values[row].unique(return_inverse=True)
        sums = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, ranks[row])
        counts = torch.bincount(inverse).to(torch.float64)
        out[row] = (sums / counts)[inverse]
    return out


def _spearman(x: Tensor, y: Tensor) -> Tensor:
    """Spearman correlation of each row of ``x (rows, n)`` with the same row of ``y``."""
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.norm(dim=-1) * ry.norm(dim=-1))


def linear_datamodeling_score(scores: Tensor, subsets: Tensor, outputs: Tensor) -> tuple[Tensor, Tensor]:
    """Linear datamodeling score: per test example, Spearman over subsets of summed scores against retrained outputs.

    See Park et al. 2023, https://arxiv.org/abs/2303.14186 (the definition dattri implements).

    Args:
        scores: ``(n_test, n_train)`` attribution scores.
        subsets: boolean ``(n_subsets, n_train)`` mask of the training examples each retrained model saw.
        outputs: ``(n_subsets, n_test)`` outputs of the model retrained on each subset.

    Returns:
        ``(mean, per_example)``: the mean over test examples (NaNs left out) and the ``(n_test,)`` correlations.

    Raises:
        ValueError: when the shapes do not agree or ``subsets`` is not boolean.

    Example:
        >>> import torch
        >>> scores = torch.tensor([[1.0, 2.0, 3.0]])
        >>> subsets = torch.tensor([[True, False, False], [False, True, True], [True, True, False]])
        >>> round(linear_datamodeling_score(scores, subsets, torch.tensor([[0.1], [0.9], [0.5]]))[1].item(), 6)
        1.0
    """
    if subsets.dtype != torch.bool:
        raise ValueError(
            f"`subsets` must be a boolean (n_subsets, n_train) mask, got {subsets.dtype}; pass mask.bool()"
        )
    if scores.ndim != 2 or subsets.ndim != 2 or outputs.ndim != 2:
        raise ValueError(
            f"expected `scores` (n_test, n_train), `subsets` (n_subsets, n_train), `outputs` (n_subsets, n_test); "
            f"got {tuple(scores.shape)}, {tuple(subsets.shape)}, {tuple(outputs.shape)}"
        )
    (n_test, n_train), (n_subsets, _) = scores.shape, subsets.shape
    if subsets.shape[1] != n_train or outputs.shape != (n_subsets, n_test):
        raise ValueError(
            f"shapes disagree: `scores` {tuple(scores.shape)}, `subsets` {tuple(subsets.shape)}, `outputs` "
            f"{tuple(outputs.shape)}; expected `subsets` ({n_subsets}, {n_train}) and `outputs` ({n_subsets}, {n_test})"
        )
    predicted = scores.double() @ subsets.double().T  # (n_test, n_subsets)
    per_example = _spearman(predicted, outputs.double().T)
    return per_example.nanmean(), per_example


def retrain_on_subsets(
    train_fn: Callable[[Tensor], Tensor], n_train: int, n_subsets: int = 50, fraction: float = 0.5, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Retrain on random subsets of the training set and collect the test outputs, for the LDS.

    Args:
        train_fn: ``train_fn(indices) -> (n_test,)`` trains on those training examples and returns the test outputs.
        n_train: number of training examples.
        n_subsets: how many subsets to draw.
        fraction: share of the training set in each subset (``round(fraction * n_train)`` examples, at least 1).
        seed: seed of the subsets' own CPU generator.

    Returns:
        ``(subsets, outputs)``: a boolean ``(n_subsets, n_train)`` mask and the ``(n_subsets, n_test)`` outputs.

    Raises:
        ValueError: when ``fraction`` is not in ``(0, 1]``.

    Example:
        >>> import torch
        >>> subsets, outputs = retrain_on_subsets(lambda idx: idx.double().sum().reshape(1), 6, n_subsets=3)
        >>> subsets.shape, outputs.shape, bool((subsets.sum(1) == 3).all())
        (torch.Size([3, 6]), torch.Size([3, 1]), True)
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"`fraction` must be in (0, 1], got {fraction}; pass e.g. fraction=0.5")
    generator = torch.Generator().manual_seed(seed)
    size = max(1, round(fraction * n_train))
    subsets = torch.zeros(n_subsets, n_train, dtype=torch.bool)
    outputs = []
    for row in range(n_subsets):
        indices = torch.randperm(n_train, generator=generator)[:size].sort().values
        subsets[row, indices] = True
        outputs.append(torch.as_tensor(train_fn(indices)).detach().reshape(-1))
    return subsets, torch.stack(outputs)
