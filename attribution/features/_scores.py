"""The scores' pure math: expected values, yes-probabilities, the simulation score and the detection metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def expected_value(probabilities: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """``(...,)`` the expected value of ``values`` under ``probabilities`` renormalised to sum to 1.

    Args:
        probabilities: ``(..., n)`` non-negative weights of the values (need not sum to 1).
        values: ``(n,)`` the values (default ``0..n-1``).

    Example:
        >>> expected_value(torch.tensor([0.2, 0.0, 0.2]))   # half 0, half 2
        tensor(1.)
    """
    p = torch.as_tensor(probabilities)
    v = torch.arange(p.shape[-1], dtype=p.dtype) if values is None else torch.as_tensor(values, dtype=p.dtype)
    return (p * v.to(p.device)).sum(-1) / p.sum(-1)


def binary_probability(p0: float, p1: float) -> float:
    """``P(1) / (P(0) + P(1))``: the probability of "yes" from those of the answers "0" and "1" (0.5 if both are 0).

    Example:
        >>> binary_probability(0.25, 0.75)
        0.75
    """
    total = p0 + p1
    return 0.5 if total <= 0 else p1 / total


def simulation_score(truth: Sequence[Sequence[float]], predicted: Sequence[Sequence[float]]) -> float | None:
    """Pearson's r between true and predicted activations over all passages' tokens concatenated (OpenAI's score).

    Not the mean of the per-passage correlations: a prediction that ranks whole passages right but not the tokens
    within them still scores well here. Pairs where either value is not finite are left out.

    Args:
        truth: one list of true activations per passage.
        predicted: one list of predictions per passage, as long as the passage's.

    Returns:
        r, or ``None`` where it is undefined: fewer than 2 tokens, or the truth or the predictions constant.

    Raises:
        ValueError: a passage whose predictions are not as many as its tokens.

    Example:
        >>> simulation_score([[0, 1], [0, 3]], [[0, 1], [0, 2]]) > 0.9, simulation_score([[0, 1]], [[5, 5]])
        (True, None)
    """
    if len(truth) != len(predicted):
        raise ValueError(f"`predicted` must hold one list per passage ({len(truth)}); got {len(predicted)}")
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, p) in enumerate(zip(truth, predicted, strict=True)):
        if len(t) != len(p):
            raise ValueError(f"passage {i} has {len(t)} tokens but {len(p)} predictions")
        for a, b in zip(t, p, strict=True):
            if math.isfinite(a) and math.isfinite(b):
                xs.append(float(a))
                ys.append(float(b))
    if len(xs) < 2 or min(xs) == max(xs) or min(ys) == max(ys):
        return None
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    return float((x @ y) / torch.sqrt((x @ x) * (y @ y)))


def auroc(truth: Sequence[bool | int], prob: Sequence[float]) -> float | None:
    """The area under the ROC curve: the chance that a positive outranks a negative, ties counting one half.

    ``None`` without positives or without negatives.

    Example:
        >>> auroc([1, 0, 1, 0], [0.9, 0.5, 0.5, 0.1])   # pairs (won, tied, won, won) of 4
        0.875
    """
    labels = [bool(t) for t in truth]
    positives = sum(labels)
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return None
    order = sorted(range(len(labels)), key=lambda i: prob[i])
    rank_sum, i = 0.0, 0
    while i < len(order):  # average ranks over runs of tied probabilities (1-based)
        j = i
        while j + 1 < len(order) and prob[order[j + 1]] == prob[order[i]]:
            j += 1
        mean_rank = (i + j) / 2 + 1
        rank_sum += mean_rank * sum(labels[order[m]] for m in range(i, j + 1))
        i = j + 1
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def detection_metrics(truth: Sequence[bool | int], prob: Sequence[float]) -> dict[str, float | None]:
    """Accuracy, balanced accuracy, F1 and AUROC of probabilistic yes/no answers (a passage is "yes" above 0.5).

    Args:
        truth: whether each passage is positive (activating, or correctly marked).
        prob: the probability of "yes" given for each passage.

    Returns:
        ``tp``, ``fp``, ``tn``, ``fn`` (counts), ``accuracy``, ``balanced_accuracy`` (``(TPR + TNR) / 2``; ``None``
        without positives or negatives), ``f1`` (``2 TP / (2 TP + FP + FN)``; ``None`` when that is 0 / 0) and
        ``auroc`` (the area under the ROC curve, ties counted half).

    Example:
        >>> m = detection_metrics([1, 1, 1, 0, 0], [0.9, 0.8, 0.2, 0.7, 0.1])
        >>> m["tp"], m["fn"], m["fp"], m["tn"], m["balanced_accuracy"], m["f1"], m["auroc"]
        (2, 1, 1, 1, 0.5833333333333333, 0.6666666666666666, 0.8333333333333334)
    """
    if len(truth) != len(prob):
        raise ValueError(f"`truth` and `prob` must be as long; got {len(truth)} and {len(prob)}")
    said = [p > 0.5 for p in prob]
    tp = sum(1 for t, s in zip(truth, said, strict=True) if t and s)
    fn = sum(1 for t, s in zip(truth, said, strict=True) if t and not s)
    fp = sum(1 for t, s in zip(truth, said, strict=True) if not t and s)
    tn = sum(1 for t, s in zip(truth, said, strict=True) if not t and not s)
    balanced = None if tp + fn == 0 or tn + fp == 0 else (tp / (tp + fn) + tn / (tn + fp)) / 2
    return {
        "tp": tp,
        "fp": fp,
        "tn": tn,
        "fn": fn,
        "accuracy": (tp + tn) / len(said) if said else None,
        "balanced_accuracy": balanced,
        "f1": None if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn),
        "auroc": auroc(truth, prob),
    }
