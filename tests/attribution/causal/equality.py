"""Hierarchical equality (pyvene's tutorial task): a causal model, its triples, and an MLP that stores its two bits."""

from __future__ import annotations

import torch
from torch import nn

V = 3  # objects are one-hot vectors of a 3-word vocabulary; an input is four objects (a, b, c, d) side by side


def causal_model(objects: torch.Tensor, left: torch.Tensor | None = None, right: torch.Tensor | None = None):
    """The high-level model: ``left = a == b``, ``right = c == d``, ``label = left == right``; variables settable."""
    left = objects[:, 0] == objects[:, 1] if left is None else left
    right = objects[:, 2] == objects[:, 3] if right is None else right
    return left, right, (left == right).long()


def triples(n: int, seed: int, variable: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(base, source, counterfactual label)``: the label when ``variable`` takes its value in the source run."""
    g = torch.Generator().manual_seed(seed)

    def draw() -> torch.Tensor:  # half the pairs equal, so each bit is balanced
        objects = torch.randint(0, V, (n, 4), generator=g)
        same = torch.rand(n, 2, generator=g) < 0.5
        objects[:, 1] = torch.where(same[:, 0], objects[:, 0], objects[:, 1])
        objects[:, 3] = torch.where(same[:, 1], objects[:, 2], objects[:, 3])
        return objects

    base, source = draw(), draw()
    src_left, src_right, _ = causal_model(source)
    setting = {"left": src_left} if variable == "left" else {"right": src_right}
    _, _, label = causal_model(base, **setting)
    return one_hot(base), one_hot(source), label


def one_hot(objects: torch.Tensor) -> torch.Tensor:
    """``(n, 4)`` object ids as ``(n, 4 * V)`` float64 inputs."""
    return nn.functional.one_hot(objects, V).flatten(1).double()


def hand_built() -> nn.Sequential:
    """An MLP whose layer ``"2"`` holds ``a == b`` in coordinate 0 and ``c == d`` in coordinate 1 (of 4), exactly.

    Layer 0: ``relu(a_i + b_i - 1)`` and ``relu(c_i + d_i - 1)`` per word ``i`` (1 only for the shared word);
    layer 2 sums each group (coordinates 2 and 3 carry other mixtures of layer 0, which the output ignores); the head
    scores "same" as ``relu(e1 + e2 - 1) + relu(1 - e1 - e2)`` against a constant 0.5.
    """
    first = nn.Linear(4 * V, 2 * V).double()
    second = nn.Linear(2 * V, 4).double()
    third = nn.Linear(4, 2).double()
    last = nn.Linear(2, 2).double()
    with torch.no_grad():
        first.weight.zero_()
        for i in range(V):
            first.weight[i, [i, V + i]] = 1.0
            first.weight[V + i, [2 * V + i, 3 * V + i]] = 1.0
        first.bias.fill_(-1.0)
        second.weight.zero_()
        second.bias.zero_()
        second.weight[0, :V] = 1.0
        second.weight[1, V:] = 1.0
        second.weight[2, 0] = 0.7
        second.weight[3, V + 1] = -0.3
        third.weight.copy_(torch.tensor([[1.0, 1.0, 0, 0], [-1.0, -1.0, 0, 0]]))
        third.bias.copy_(torch.tensor([-1.0, 1.0]))
        last.weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        last.bias.copy_(torch.tensor([0.5, 0.0]))
    return nn.Sequential(first, nn.ReLU(), second, third, nn.ReLU(), last).eval()
