"""Parity with captum 0.9 in float64 on the models captum supports: DeepLift, DeepLiftShap, GradientShap.

The agreement is to float64 round-off (``rtol=1e-10``; the issue asks 1e-6). GradientShap is compared on the same
draws: captum's ``np.random.choice``, ``torch.normal`` and ``np.random.uniform`` are fed ours
(:func:`attribution.reference.draw`). captum's DeepLift differs where two of its hooked modules are adjacent
(``ReLU -> MaxPool``, as in VGG): it reads the gradient at a module's output before the next module's rule rewrote
it, and its sums then miss ``f(x) - f(baseline)``; the last test records that and that ours sums exactly.
"""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from attribution import DeepLift, DeepLiftShap, GradientShap
from attribution.reference import draw

captum_attr = pytest.importorskip("captum.attr")
pytestmark = pytest.mark.peers

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-13}
ACTIVATIONS = [nn.ReLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.LeakyReLU, nn.Softplus]


def mlp(act: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), act(), nn.Linear(7, 6), act(), nn.Linear(6, 4)).double().eval()


def cnn() -> nn.Module:
    """Conv -> in-place ReLU -> conv -> MaxPool -> Tanh -> conv -> MaxPool -> linear: no two rule modules adjacent."""
    torch.manual_seed(1)
    return (
        nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(6, 6, 1),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3),
            nn.Tanh(),
            nn.Conv2d(8, 8, 1),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * 2 * 2, 5),
        )
        .double()
        .eval()
    )


def captum(method: str, model: nn.Module, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # captum warns about its hooks at every call
        return getattr(captum_attr, method)(model).attribute(*args, return_convergence_delta=True, **kwargs)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=[a.__name__ for a in ACTIVATIONS])
def test_deeplift_matches_captum_on_mlps(act):
    model = mlp(act)
    x, b = torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64)
    ours = DeepLift(model, b)(x, target=[0, 3, 1, 2], return_delta=True)
    theirs, delta = captum("DeepLift", model, x, b, target=[0, 3, 1, 2])
    torch.testing.assert_close(ours.attributions, theirs, **TIGHT)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-12)


def test_deeplift_matches_captum_on_a_cnn_with_max_pools():
    model = cnn()
    x, b = torch.randn(3, 3, 12, 12, dtype=F64), torch.randn(3, 12, 12, dtype=F64) * 0.3
    ours = DeepLift(model, b)(x, target=2)
    theirs, _ = captum("DeepLift", model, x, b.expand_as(x).contiguous(), target=2)
    torch.testing.assert_close(ours, theirs, **TIGHT)
    multipliers = DeepLift(model, b, multiply_by_inputs=False)(x, target=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = captum_attr.DeepLift(model, multiply_by_inputs=False).attribute(x, b.expand_as(x).contiguous(), 2)
    torch.testing.assert_close(multipliers, plain, **TIGHT)


def test_deepliftshap_matches_captum():
    model = cnn()
    x, refs = torch.randn(2, 3, 12, 12, dtype=F64), torch.randn(4, 3, 12, 12, dtype=F64)
    ours = DeepLiftShap(model, refs)(x, target=[1, 4], return_delta=True)
    theirs, delta = captum("DeepLiftShap", model, x, refs, target=[1, 4])
    torch.testing.assert_close(ours.attributions, theirs, **TIGHT)
    torch.testing.assert_close(ours.delta, delta.view(2, 4).mean(1), rtol=0, atol=1e-12)  # captum: per pair


@pytest.mark.parametrize("stdevs", [0.0, 0.3])
def test_gradientshap_matches_captum_on_the_same_draws(stdevs):
    model = cnn()
    x, refs = torch.randn(3, 3, 12, 12, dtype=F64), torch.randn(5, 3, 12, 12, dtype=F64)
    d = draw(3, 4, 5, (3, 12, 12), stdevs, seed=5)
    noise = d.noise if d.noise is not None else torch.zeros(12, 3, 12, 12, dtype=F64)
    with (
        mock.patch("numpy.random.choice", return_value=d.index.numpy()),
        mock.patch("numpy.random.uniform", return_value=d.alpha.numpy()),
        mock.patch("torch.normal", return_value=noise),
    ):
        theirs, delta = captum("GradientShap", model, x, refs, n_samples=4, stdevs=stdevs, target=[0, 2, 4])
    ours = GradientShap(model, refs, samples=4, stdevs=stdevs, seed=5)(x, target=[0, 2, 4], return_delta=True)
    torch.testing.assert_close(ours.attributions, theirs, **TIGHT)
    torch.testing.assert_close(ours.delta, delta.view(3, 4).mean(1), rtol=0, atol=1e-12)  # captum: per draw


def test_captum_misses_the_sum_where_relu_feeds_a_max_pool_and_ours_does_not():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3)).double()
    x, b = torch.randn(3, 3, 6, 6, dtype=F64), torch.randn(3, 3, 6, 6, dtype=F64) * 0.3
    ours = DeepLift(model, b)(x, target=1, return_delta=True)
    _, theirs = captum("DeepLift", model, x, b, target=1)
    assert float(ours.delta.abs().max()) < 1e-12
    assert float(theirs.abs().max()) > 1e-3
