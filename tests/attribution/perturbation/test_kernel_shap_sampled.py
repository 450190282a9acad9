"""Sampled KernelSHAP pinned by known answers: 12 features, so 2,048 samples stay below the 4,094 coalitions.

The exact Shapley values come from the definition, ``phi_i = sum_S |S|! (M - |S| - 1)! / M! (v(S + i) - v(S))``
over all ``2^12`` coalitions, computed here in float64 (``ShapleyValues`` stops at 10 features). The sampled
estimate's error must fall as samples grow, and the coalition sizes KernelSHAP evaluates must follow the Shapley
kernel, ``p(k) ~ (M - 1) / (k (M - k))`` (a chi-square test on what the model is actually called with).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from attribution import KernelSHAP

M = 12
F64 = torch.float64


class Tangle(nn.Module):
    """A non-additive function of 12 inputs: a linear part, pair and triple products, a product of four, a sine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.linspace(-1.0, 1.5, M, dtype=x.dtype)
        first = (
            x @ w + 2 * x[:, 0] * x[:, 3] - 1.5 * x[:, 1] * x[:, 2] * x[:, 7] + torch.sin(x[:, 4] * x[:, 9])
            + x[:, 5:9].prod(1) + x[:, 10] * x[:, 11] * x[:, 0]
        )  # fmt: skip
        return torch.stack([first, x[:, 2] * x[:, 6]], 1)


def exact_shapley(model: nn.Module, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The Shapley values of output 0 by the subset formula, ``(batch, M)``, every coalition evaluated once."""
    masks = torch.tensor(list(itertools.product([False, True], repeat=M)))  # row r: the bits of r, feature 0 first
    bit = 2 ** torch.arange(M - 1, -1, -1)
    code, size = (masks.long() * bit).sum(1), masks.sum(1)
    weight = torch.tensor(
        [math.factorial(s) * math.factorial(M - s - 1) / math.factorial(M) for s in range(M)], dtype=F64
    )
    phi = torch.zeros(len(x), M, dtype=F64)
    with torch.no_grad():
        for b, item in enumerate(x):
            v = model(torch.where(masks, item, base))[:, 0]
            for i in range(M):
                without = ~masks[:, i]
                phi[b, i] = (weight[size[without]] * (v[code[without] + bit[i]] - v[without])).sum()
    return phi


@pytest.fixture(scope="module")
def case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, M, dtype=F64, generator=generator) * 1.5
    base = torch.randn(M, dtype=F64, generator=generator) * 0.3
    return x, base, exact_shapley(Tangle(), x, base)


def test_the_exact_values_are_efficient_and_not_additive(case):
    x, base, exact = case
    model = Tangle()
    gain = model(x)[:, 0] - model(base[None])[0, 0]
    torch.testing.assert_close(exact.sum(1), gain.detach(), rtol=1e-12, atol=1e-12)
    linear_part = torch.linspace(-1.0, 1.5, M, dtype=F64) * (x - base)
    assert (exact - linear_part).abs().max() > 1.0, "the interactions must move the values off the linear part"


@pytest.mark.slow
def test_the_sampled_estimate_approaches_the_exact_values_as_samples_grow(case):
    """Relative L2 error over 6 seeds; measured: mean 0.31 / 0.15 / 0.088 and max 0.37 / 0.16 / 0.11."""
    x, base, exact = case
    errors = {}
    for samples in (128, 512, 2048):
        errors[samples] = []
        for seed in range(6):
            got = KernelSHAP(Tangle(), baseline=base, samples=samples, seed=seed, show_progress=False)(x, target=0)
            torch.testing.assert_close(got.sum(1), exact.sum(1), rtol=1e-10, atol=1e-10)  # efficiency stays exact
            errors[samples].append(float((got - exact).norm() / exact.norm()))
    mean = {n: sum(e) / len(e) for n, e in errors.items()}
    assert mean[128] > mean[512] > mean[2048], mean
    assert mean[2048] < 0.5 * mean[128], f"the error must fall about as 1/sqrt(samples): {mean}"
    assert max(errors[2048]) < 0.15, errors[2048]


class Recorder(nn.Module):
    """Records every input row it is called with; its output is a sum and a product of them."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.detach().clone())
        return torch.stack([x.sum(1), x.prod(1)], 1)


@pytest.mark.parametrize("seed", [0, 4, 9])
def test_the_drawn_coalition_sizes_follow_the_shapley_kernel(seed):
    """Baseline 0 and inputs 1..12: a row's non-zero count is its coalition's size."""
    stats = pytest.importorskip("scipy.stats")
    model = Recorder()
    KernelSHAP(model, baseline=0.0, samples=2048, seed=seed, show_progress=False)(
        torch.arange(1, M + 1, dtype=F64)[None], target=0
    )
    size = (torch.cat(model.rows) != 0).sum(1)
    assert len(size) == 2048 + 2 and int((size == 0).sum()) == 1 and int((size == M).sum()) == 1  # + empty and full
    size = size[(size > 0) & (size < M)]
    k = torch.arange(1, M, dtype=F64)
    kernel = (M - 1) / (k * (M - k))
    expected = kernel / kernel.sum() * len(size)
    observed = torch.bincount(size, minlength=M)[1:M].double()
    result = stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, f"sizes {observed.tolist()} against the kernel's {expected.round().tolist()}"
