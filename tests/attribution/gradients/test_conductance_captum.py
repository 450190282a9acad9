"""Conductance family against captum 0.9 on its own test models, float64, at 1e-6 relative."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution import InternalInfluence, LayerConductance, NeuronConductance, NeuronIntegratedGradients

captum = pytest.importorskip("captum.attr")
models = pytest.importorskip("captum.testing.helpers.basic_models")


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """1e-6 relative to the largest value (captum keeps its quadrature weights in float32)."""
    assert ours.shape == theirs.shape and theirs.abs().max() > 0
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-6, atol=1e-6 * float(theirs.abs().max()))


def _own_conv() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 5, 4)).double()


def _cases() -> list[tuple[str, nn.Module, str, torch.Tensor, list[int], tuple[int, ...]]]:
    torch.manual_seed(0)
    dilated = models.BasicModel_ConvNetWithPaddingDilation().double()
    return [
        ("multilayer", models.BasicModel_MultiLayer().double(), "linear1", 40 * torch.randn(3, 3), [0, 1, 0], (2,)),
        (
            "one_conv",
            models.BasicModel_ConvNet_One_Conv().double(),
            "conv1",
            40 + 30 * torch.randn(2, 1, 4, 4),
            [1, 3],
            (1, 1, 0),
        ),
        ("dilated", dilated, "conv1", torch.randn(3, 1, 2, 14), [5, 4, 7], (1, 0, 1)),
        ("own_conv", _own_conv(), "1", torch.randn(2, 2, 5, 7), [3, 0], (2, 1, 3)),
    ]


CASES = _cases()
RULES = ["gausslegendre", "riemann_trapezoid", "riemann_right"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_methods_equal_captum(case: tuple, rule: str) -> None:
    _, model, layer, x, target, _ = case
    x = x.double()
    module = dict(model.named_modules())[layer]
    base = 0.1 * torch.randn(1, *x.shape[1:], dtype=torch.float64)
    ours, delta = LayerConductance(model, layer, steps=9, method=rule, baseline=base)(x, target, return_delta=True)
    theirs, their_delta = captum.LayerConductance(model, module).attribute(
        x, baselines=base, target=target, n_steps=9, method=rule, return_convergence_delta=True
    )
    _close(ours, theirs)
    torch.testing.assert_close(delta, their_delta.double(), rtol=1e-6, atol=1e-6 * float(theirs.abs().max()))
    chunked = LayerConductance(model, layer, steps=9, method=rule, baseline=base, internal_batch_size=4 * len(x))
    _close(chunked(x, target), theirs)
    ours = InternalInfluence(model, layer, steps=9, method=rule, baseline=base, internal_batch_size=3)(x, target)
    theirs = captum.InternalInfluence(model, module).attribute(x, baselines=base, target=target, n_steps=9, method=rule)
    _close(ours, theirs)


@pytest.mark.parametrize("multiply", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_neuron_methods_equal_captum(case: tuple, multiply: bool) -> None:
    _, model, layer, x, target, neuron = case
    x = x.double()
    module = dict(model.named_modules())[layer]
    base = 0.1 * torch.randn(1, *x.shape[1:], dtype=torch.float64)
    options = {"steps": 8, "method": "riemann_trapezoid", "baseline": base, "multiply_by_inputs": multiply}
    indexed = NeuronConductance(model, layer, **options, internal_batch_size=5)(x, neuron, target)
    theirs = captum.NeuronConductance(model, module, multiply_by_inputs=multiply).attribute(
        x, neuron, baselines=base, target=target, n_steps=8, method="riemann_trapezoid"
    )
    _close(indexed, theirs)
    ours = NeuronIntegratedGradients(model, layer, **options)(x, neuron)
    theirs = captum.NeuronIntegratedGradients(model, module, multiply_by_inputs=multiply).attribute(
        x, neuron, baselines=base, n_steps=8, method="riemann_trapezoid"
    )
    _close(ours, theirs)

    def select(y: torch.Tensor) -> torch.Tensor:
        return y[(slice(None), *neuron)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # captum warns about callable selectors
        theirs = captum.NeuronConductance(model, module, multiply_by_inputs=multiply).attribute(
            x,
            select,
            baselines=base,
            target=target,
            n_steps=8,  # captum's default rule: riemann_trapezoid
        )
    ours = NeuronConductance(model, layer, **options)(x, select, target)
    torch.testing.assert_close(ours, indexed, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * float(indexed.abs().max()))
