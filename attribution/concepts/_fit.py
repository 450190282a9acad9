"""The classifiers behind a CAV: pure tensor code, on the activations' device, deterministic.

Rows ``x (n, d)`` (flattened activations) and labels ``y (n,)`` (1 for the concept, 0 for the counterexamples) in, a
linear rule ``x . w + b > 0`` in the activations' own coordinates out. The logistic and SGD classifiers see the rows
centred and divided by one number (the root mean square of the centred rows' norms), which leaves directions as they
are and makes the fit's constants independent of the layer's size and scale.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

Kind = Literal["logistic", "sgd", "mean"]
KINDS = ("logistic", "sgd", "mean")


def split(labels: torch.Tensor, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out row indices: ``floor(held_out * n_c)`` random rows of each class held out (seeded).

    Example:
        >>> train, test = split(torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0]), 0.25, seed=0)
        >>> len(train), len(test), sorted(torch.cat([train, test]).tolist()) == list(range(9))
        (7, 2, True)
    """
    generator = torch.Generator().manual_seed(seed)
    train, test = [], []
    for value in (1, 0):
        rows = (labels.cpu() == value).nonzero().flatten()
        rows = rows[torch.randperm(len(rows), generator=generator)]
        count = min(int(held_out * len(rows)), len(rows) - 1)
        test.append(rows[:count])
        train.append(rows[count:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def fit(x: torch.Tensor, y: torch.Tensor, kind: Kind, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule ``(w (d,), b ())`` of the ``kind`` classifier fitted to rows ``x`` with labels ``y`` (1 = concept).

    Example:
        >>> x = torch.tensor([[2.0, 1.0], [4.0, 1.0], [0.0, 5.0], [0.0, 7.0]])
        >>> w, b = fit(x, torch.tensor([1, 1, 0, 0]), "mean")
        >>> w.tolist(), b.item()                           # mean (3, 1) minus mean (0, 6); midpoint (1.5, 3.5)
        ([3.0, -5.0], 13.0)
    """
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    positive = y.to(x.device) == 1
    if kind == "mean":
        w = x[positive].mean(0) - x[~positive].mean(0)
        return w, -w @ (x[positive].mean(0) + x[~positive].mean(0)) / 2
    centre = x.mean(0)
    scale = (x - centre).pow(2).sum(1).mean().sqrt()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = (x - centre) / scale
    signs = positive.to(x.dtype) * 2 - 1
    w, b = logistic(z, signs) if kind == "logistic" else sgd(z, signs, seed)
    return w / scale, b - centre @ w / scale


def logistic(z: torch.Tensor, signs: torch.Tensor, *, l2: float = 1e-3, steps: int = 200) -> tuple[torch.Tensor, ...]:
    """L2-regularised logistic regression ``mean log(1 + exp(-s (z . w + b))) + l2/2 |w|^2``, full-batch L-BFGS.

    The objective is strictly convex and the start is 0: the answer is the same on every run. It stops at a gradient
    of ``1e-10`` in float64 (``1e-5`` in float32), or after ``steps`` iterations.
    """
    w = torch.zeros(z.shape[1], dtype=z.dtype, device=z.device, requires_grad=True)
    b = torch.zeros((), dtype=z.dtype, device=z.device, requires_grad=True)
    double = z.dtype == torch.float64  # to the gradient float64 resolves; float32 stops at its own precision
    optimiser = torch.optim.LBFGS(
        [w, b],
        max_iter=steps,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-10 if double else 1e-5,
        tolerance_change=0.0 if double else 1e-9,
    )

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = torch.nn.functional.softplus(-signs * (z @ w + b)).mean() + 0.5 * l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    return w.detach(), b.detach()


def sgd(
    z: torch.Tensor, signs: torch.Tensor, seed: int, *, alpha: float = 0.01, epochs: int = 20, batch: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear SVM by minibatch SGD, as scikit-learn's ``SGDClassifier(alpha=0.01)`` that captum uses.

    Hinge loss ``mean max(0, 1 - s (z . w + b)) + alpha/2 |w|^2``, ``epochs`` passes over the rows in a seeded order,
    step ``1 / (1 + alpha t)`` at step ``t`` (Bottou's schedule), closed-form gradients (no autograd).
    """
    generator = torch.Generator().manual_seed(seed)
    w = torch.zeros(z.shape[1], dtype=z.dtype, device=z.device)
    b = 0.0
    t = 0
    for _ in range(epochs):
        order = torch.randperm(len(z), generator=generator).to(z.device)
        for rows, s in zip(z[order].split(batch), signs[order].split(batch), strict=True):
            rate = 1.0 / (1.0 + alpha * t)
            active = (s * (rows @ w + b) < 1).to(z.dtype) * s  # hinge: the rows inside the margin pull
            w.mul_(1 - rate * alpha).add_(active @ rows, alpha=rate / len(rows))
            b += rate * float(active.sum()) / len(rows)
            t += 1
    return w, torch.tensor(b, dtype=z.dtype, device=z.device)


def accuracy(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of rows on the side of the rule their label says (``nan`` for no rows)."""
    if len(x) == 0:
        return float("nan")
    predicted = (x.to(w.dtype) @ w + b) > 0
    return float((predicted == (y.to(x.device) == 1)).double().mean())


def direction(
    pos: torch.Tensor, neg: torch.Tensor, layer: str, kind: Kind, seed: int, held_out: float
) -> tuple[torch.Tensor, float]:
    """The unit CAV of recorded rows ``pos (m, d)`` (the concept) against ``neg (k, d)``, and its held-out accuracy.

    Example:
        >>> pos, neg = torch.tensor([[2.0, 1.0], [4.0, 1.0]]), torch.tensor([[0.0, 5.0], [0.0, 7.0]])
        >>> direction(pos, neg, "0", "mean", seed=0, held_out=0.0)
        (tensor([ 0.5145, -0.8575]), nan)
    """
    x = torch.cat([pos, neg])
    y = torch.cat([torch.ones(len(pos), dtype=torch.long), torch.zeros(len(neg), dtype=torch.long)])
    train, test = split(y, held_out, seed)
    w, b = fit(x[train.to(x.device)], y[train], kind, seed)
    length = float(w.norm())
    if not math.isfinite(length) or length == 0:
        raise ValueError(
            f"the concept's examples and the counterexamples cannot be told apart at layer {layer!r} (the "
            f"{kind} classifier's normal is {'zero' if length == 0 else 'not finite'}): their activations are the "
            "same there, or not finite. Use different examples, or a layer where they differ"
        )
    return w / length, accuracy(w, b, x[test.to(x.device)], y[test])


def check_options(kind: Any, held_out: Any) -> None:
    """Refuse an unknown ``kind`` and a ``held_out`` share outside ``[0, 1)``."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(repr(k) for k in KINDS)}; got {kind!r}")
    if not isinstance(held_out, (int, float)) or not 0 <= held_out < 1:
        raise ValueError(f"`held_out` must be a share in [0, 1); got {held_out!r}")
