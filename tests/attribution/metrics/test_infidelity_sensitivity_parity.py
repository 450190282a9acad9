"""Infidelity and max-sensitivity against captum 0.9's ``metrics.infidelity`` and ``metrics.sensitivity_max``, live.

Both sides get the same draws. For infidelity the same perturbation function, with a generator seeded alike on each
side, is called on the same repeated inputs (captum's ``max_examples_per_batch`` is our ``batch_size``: the same
chunks). For sensitivity captum's ``perturb_func`` draws hookscope's documented noise (copy by copy, ``(B, ...)``
each, interleaved item-major). Float64 throughout; the tolerances are rounding of the same operations in another
order (einsum against captum's elementwise product and sum).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attribution import Saliency
from attribution.metrics import infidelity, sensitivity_max

captum_metrics = pytest.importorskip("captum.metrics")
captum_attr = pytest.importorskip("captum.attr")

pytestmark = [
    pytest.mark.peers,
    pytest.mark.filterwarnings("ignore:`max_examples_per_batch` must be:UserWarning"),  # captum, for batch_size 1
    pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients:UserWarning"),  # captum
]


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 7, 3)).double().eval()
    )


@pytest.fixture
def images() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 3, 5, 7, dtype=torch.float64)  # non-square


def gaussian(inputs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    noise = 0.1 * torch.randn(inputs.shape, generator=generator, dtype=inputs.dtype)
    return noise, inputs - noise


def for_captum(perturb, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda inputs: perturb(inputs, generator)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("batch_size", [1, 6, 100])
def test_infidelity_equals_captums(model, images, normalize, batch_size):
    phi = torch.randn_like(images)
    ours = infidelity(model, phi, images, gaussian, [0, 2, 1], n=7, normalize=normalize, batch_size=batch_size, seed=3)
    theirs = captum_metrics.infidelity(
        model,
        for_captum(gaussian, 3),
        images,
        phi,
        target=[0, 2, 1],
        n_perturb_samples=7,
        max_examples_per_batch=batch_size,
        normalize=normalize,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-18)


def test_infidelity_of_two_inputs_and_one_output_per_item_equals_captums():
    torch.manual_seed(2)
    left, right = nn.Linear(4, 3).double(), nn.Linear(2, 3).double()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = left, right

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (torch.tanh(self.left(a)) * self.right(b)).sum(1)  # (B,): read as it is

    def perturb(inputs, generator):
        noise = tuple(0.3 * torch.randn(x.shape, generator=generator, dtype=x.dtype) for x in inputs)
        return noise, tuple(x - e for x, e in zip(inputs, noise, strict=True))

    inputs = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    phi = (torch.randn(4, 4, dtype=torch.float64), -torch.rand(4, 2, dtype=torch.float64))
    ours = infidelity(Two().eval(), phi, inputs, perturb, n=5, batch_size=8, seed=1)
    theirs = captum_metrics.infidelity(
        Two().eval(), for_captum(perturb, 1), inputs, phi, n_perturb_samples=5, max_examples_per_batch=8
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-18)


def documented_noise(seed: int, batch: int):
    """captum's ``perturb_func`` drawing hookscope's noise for the repeated inputs it is given."""
    generator = torch.Generator().manual_seed(seed)

    def perturb(inputs, radius):
        def one_chunk(x: torch.Tensor, draws: list[torch.Tensor]) -> torch.Tensor:
            u = torch.stack(draws, dim=1).flatten(0, 1)
            return x + (2 * u - 1) * radius

        parts = inputs if isinstance(inputs, tuple) else (inputs,)
        k = len(parts[0]) // batch
        items = [x[::k] for x in parts]
        draws = [[torch.rand(x.shape, generator=generator, dtype=x.dtype) for x in items] for _ in range(k)]
        noisy = tuple(one_chunk(x, [copy[t] for copy in draws]) for t, x in enumerate(parts))
        return noisy if isinstance(inputs, tuple) else noisy[0]

    return perturb


@pytest.mark.parametrize("norm", ["fro", 1, math.inf])
@pytest.mark.parametrize("batch_size", [3, 6, 100])
def test_sensitivity_of_saliency_equals_captums(model, images, norm, batch_size):
    ours = sensitivity_max(
        Saliency(model), images, [0, 2, 1], radius=0.1, n=7, norm=norm, seed=4, batch_size=batch_size
    )
    perturb = documented_noise(4, batch=3)
    theirs = captum_metrics.sensitivity_max(
        captum_attr.Saliency(model).attribute,
        images,
        perturb_func=perturb,
        perturb_radius=0.1,
        n_perturb_samples=7,
        norm_ord=norm,
        max_examples_per_batch=batch_size,
        target=[0, 2, 1],
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-18)


def test_sensitivity_of_a_function_of_two_inputs_equals_captums():
    torch.manual_seed(3)
    inputs = (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, 2, dtype=torch.float64))

    def method(parts):
        a, b = parts
        return a * a.sum(1, keepdim=True), b.tanh() * 3

    ours = sensitivity_max(method, inputs, radius=0.3, n=5, seed=2, batch_size=4)
    perturb = documented_noise(2, batch=2)
    theirs = captum_metrics.sensitivity_max(
        method,
        inputs,
        perturb_func=perturb,
        perturb_radius=0.3,
        n_perturb_samples=5,
        max_examples_per_batch=4,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-18)
