"""The probes themselves: L2-regularised logistic regression and a one-hidden-layer MLP, fitted in float64.

Pure tensor code, no hooks: rows ``x (n, d)`` and integer labels ``y (n,)`` in, a prediction function out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Predict = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Standardiser:
    """Centre and scale each column by the training rows' mean and standard deviation (1 where it is 0)."""

    mean: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor) -> Standardiser:
        std = x.std(0, unbiased=False)
        return cls(x.mean(0), torch.where(std > 0, std, torch.ones_like(std)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


@dataclass(frozen=True)
class LinearProbe:
    """Logits ``x W^T + b`` in the activations' own coordinates (the standardisation folded in)."""

    weight: torch.Tensor  # (classes, d)
    bias: torch.Tensor  # (classes,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def fit_linear(x: torch.Tensor, y: torch.Tensor, classes: int, *, l2: float = 1e-3, steps: int = 500) -> LinearProbe:
    """Multinomial logistic regression: minimise ``mean CE + l2/2 |W|^2`` on standardised rows (convex; L-BFGS).

    Example:
        >>> x = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]], dtype=torch.float64)
        >>> probe = fit_linear(x, torch.tensor([0, 0, 1, 1]), 2)
        >>> probe(x).argmax(1).tolist()
        [0, 0, 1, 1]
    """
    norm = Standardiser.fit(x)
    z = norm(x)
    weight = torch.zeros(classes, x.shape[1], dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(classes, dtype=x.dtype, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [weight, bias], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-10, tolerance_change=1e-15
    )

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = linear_objective(z, y, weight, bias, l2)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    w, b = weight.detach() / norm.scale, bias.detach()
    return LinearProbe(w, b - norm.mean @ w.T)


def linear_objective(
    z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, l2: float
) -> torch.Tensor:
    """``mean_i CE(z_i W^T + b, y_i) + l2/2 |W|_F^2``: what :func:`fit_linear` minimises."""
    return torch.nn.functional.cross_entropy(z @ weight.T + bias, y) + 0.5 * l2 * weight.pow(2).sum()


def fit_mlp(
    x: torch.Tensor, y: torch.Tensor, classes: int, *, hidden: int = 128, steps: int = 300, seed: int = 0
) -> Predict:
    """A ReLU MLP with one hidden layer on standardised rows, full-batch Adam (lr 1e-2, weight decay 1e-4)."""
    norm = Standardiser.fit(x)
    generator = torch.Generator().manual_seed(seed)
    d = x.shape[1]
    w1 = (torch.randn(hidden, d, generator=generator, dtype=x.dtype) / d**0.5).requires_grad_(True)
    b1 = torch.zeros(hidden, dtype=x.dtype, requires_grad=True)
    w2 = (torch.randn(classes, hidden, generator=generator, dtype=x.dtype) / hidden**0.5).requires_grad_(True)
    b2 = torch.zeros(classes, dtype=x.dtype, requires_grad=True)

    def predict(rows: torch.Tensor) -> torch.Tensor:
        return torch.relu(norm(rows) @ w1.T + b1) @ w2.T + b2

    optimiser = torch.optim.Adam([w1, b1, w2, b2], lr=1e-2, weight_decay=1e-4)
    with torch.enable_grad():
        for _ in range(steps):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(predict(x), y).backward()
            optimiser.step()
    for p in (w1, b1, w2, b2):
        p.requires_grad_(False)
    return predict


def accuracy(predict: Predict, x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of rows whose largest logit is their label."""
    with torch.no_grad():
        return float((predict(x).argmax(1) == y).double().mean())


def directions(probe: LinearProbe) -> torch.Tensor:
    """Unit directions of a linear probe, each of length 1.

    ``(d,)`` along ``w_1 - w_0`` for two classes, else ``(classes, d)`` rows ``w_c - mean_c w_c`` (a class's logit
    against the average).

    Example:
        >>> directions(LinearProbe(torch.tensor([[0.0, -1.0], [0.0, 3.0]]), torch.zeros(2)))
        tensor([0., 1.])
    """
    w = probe.weight
    rows = (w[1] - w[0])[None] if w.shape[0] == 2 else w - w.mean(0)
    lengths = rows.norm(dim=1, keepdim=True)
    units = rows / torch.where(lengths > 0, lengths, torch.ones_like(lengths))
    return units[0] if w.shape[0] == 2 else units
