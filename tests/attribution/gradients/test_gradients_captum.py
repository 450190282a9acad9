"""Parity with captum 0.9, per method and per Integrated Gradients rule, on a small ResNet and a small VGG (float64).

Tolerances: the gradient methods agree to float64 round-off (``rtol=1e-10, atol=1e-12``). Integrated Gradients and
Guided Grad-CAM agree to ``rtol=1e-6``: captum multiplies the gradients by its step sizes as float32
(``torch.tensor(step_sizes).float()`` in ``captum.attr._core.integrated_gradients``), a relative rounding of up to
6e-8 per weight, and captum takes its Riemann nodes from ``torch.linspace`` in the default dtype (float64 here,
for the captum call only).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from attribution import (
    Deconvolution,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)
from tests.attribution.models import SCALAR_TARGETS, ScalarPolynomials, ScalarReLUs, scalars

captum_attr = pytest.importorskip("captum.attr")
torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.peers

TIGHT = {"rtol": 1e-10, "atol": 1e-12}
STEP_SIZES_IN_FLOAT32 = {"rtol": 1e-6, "atol": 1e-10}
RULES = ["gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid"]


def small_resnet() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=7)
    return model.double().eval()


def small_vgg() -> nn.Module:
    """torchvision's VGG with few channels and the classifier narrowed (in-place ReLUs throughout)."""
    torch.manual_seed(1)
    features = torchvision.models.vgg.make_layers([8, "M", 16, "M", 16, 16, "M"])
    model = torchvision.models.vgg.VGG(features, num_classes=6, init_weights=False)
    model.avgpool = nn.AdaptiveAvgPool2d((2, 2))
    model.classifier = nn.Sequential(
        nn.Linear(16 * 2 * 2, 12), nn.ReLU(True), nn.Dropout(), nn.Linear(12, 12), nn.ReLU(True), nn.Linear(12, 6)
    )
    return model.double().eval()


MODELS = {"resnet": small_resnet, "vgg": small_vgg}
# Guided Grad-CAM layers whose output no in-place ReLU changes afterwards (a block output; a max pool)
GRADCAM_LAYERS = {"resnet": "layer3", "vgg": "features.9"}


@pytest.fixture(params=sorted(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[str, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    x = torch.randn(3, 3, 32, 40, dtype=torch.float64)  # non-square images
    return request.param, MODELS[request.param](), x, torch.tensor([1, 4, 2])


@contextmanager
def float64_default() -> Iterator[None]:
    """captum builds its Riemann nodes and its noise in the default dtype: float64 for the captum call."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def captum(cls: type, model: nn.Module, *args, **kwargs) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model, *args, **kwargs)


@pytest.mark.parametrize("signed", [False, True])
def test_saliency(case, signed):
    _, model, x, target = case
    expected = captum(captum_attr.Saliency, model).attribute(x, target=target, abs=not signed)
    torch.testing.assert_close(Saliency(model, abs=not signed)(x, target), expected, **TIGHT)


def test_input_x_gradient(case):
    _, model, x, target = case
    expected = captum(captum_attr.InputXGradient, model).attribute(x, target=target)
    torch.testing.assert_close(InputXGradient(model)(x, target), expected, **TIGHT)


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_integrated_gradients_every_rule(case, rule):
    _, model, x, target = case
    baseline = torch.rand_like(x)
    with float64_default():
        expected, delta = captum(captum_attr.IntegratedGradients, model).attribute(
            x, baselines=baseline, target=target, n_steps=8, method=rule, return_convergence_delta=True
        )
    ours = IntegratedGradients(model, steps=8, method=rule, baseline=baseline, internal_batch_size=7)
    got, got_delta = ours(x, target, return_delta=True)
    torch.testing.assert_close(got, expected, **STEP_SIZES_IN_FLOAT32)
    torch.testing.assert_close(got_delta, delta, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("method", [GuidedBackprop, Deconvolution])
def test_modified_relu_methods(case, method):
    _, model, x, target = case
    expected = captum(getattr(captum_attr, method.__name__), model).attribute(x, target=target)
    torch.testing.assert_close(method(model)(x, target), expected, **TIGHT)


@pytest.mark.filterwarnings("ignore:GuidedGradCAM. the attributions of item")  # an item whose Grad-CAM is all cut
@pytest.mark.filterwarnings("ignore:the gradient of the target score")
def test_guided_gradcam(case):
    name, model, x, target = case
    layer = GRADCAM_LAYERS[name]
    expected = captum(captum_attr.GuidedGradCam, model, model.get_submodule(layer)).attribute(x, target=target)
    got = GuidedGradCAM(model, layer)(x, target)
    assert int((got.flatten(1).abs().amax(1) > 0).sum()) >= 2  # the comparison is not between zeros
    torch.testing.assert_close(got, expected, **TIGHT)


@pytest.mark.filterwarnings("ignore:GuidedGradCAM. the attributions of item")
def test_guided_gradcam_at_a_layer_an_inplace_relu_overwrites_matches_captum():
    """captum 0.9 reads the convolution's true output too, not the tensor the ReLU(inplace=True) after it overwrote."""
    model, layer = small_vgg(), "features.8"
    assert isinstance(model.features[9], nn.ReLU) and model.features[9].inplace
    torch.manual_seed(2)
    x, target = torch.randn(3, 3, 32, 40, dtype=torch.float64), torch.tensor([1, 4, 2])
    expected = captum(captum_attr.GuidedGradCam, model, model.get_submodule(layer)).attribute(x, target=target)
    got = GuidedGradCAM(model, layer)(x, target)
    assert float(got.abs().max()) > 0
    torch.testing.assert_close(got, expected, **TIGHT)


@pytest.mark.slow
def test_smoothgrad_draws_captums_noise():
    """Same seed, same draw: captum's ``torch.normal`` on the global generator, ours on a generator of our own."""
    model, x = small_resnet(), torch.randn(1, 3, 24, 20, dtype=torch.float64)
    stdev = 0.2 * float(x.max() - x.min())
    with float64_default():
        torch.manual_seed(5)
        tunnel = captum_attr.NoiseTunnel(captum(captum_attr.Saliency, model))
        expected = tunnel.attribute(x, nt_type="smoothgrad", nt_samples=6, stdevs=stdev, target=3)
    got = SmoothGrad(Saliency(model), samples=6, noise=0.2, seed=5, batch_size=4)(x, target=3)
    torch.testing.assert_close(got, expected, **TIGHT)


class TokenModel(nn.Module):
    """Embedding -> tanh MLP over the mean token -> logits: a language-model stand-in for the layer variants."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(ids)).mean(1)


@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_middle"])
def test_layer_integrated_gradients_on_token_ids(rule):
    torch.manual_seed(3)
    model = TokenModel().double().eval()
    ids, pad = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 10]]), torch.zeros(2, 4, dtype=torch.long)
    with float64_default():
        lig = captum(captum_attr.LayerIntegratedGradients, model, model.embed)
        expected = lig.attribute(ids, baselines=pad, target=2, n_steps=12, method=rule)
    got = IntegratedGradients(model, steps=12, method=rule, baseline=pad, layer="embed")(ids, target=2)
    assert got.shape == (2, 4, 6)
    torch.testing.assert_close(got, expected, **STEP_SIZES_IN_FLOAT32)


def test_layer_input_x_gradient(case):
    _, model, x, target = case
    layer = "layer2" if isinstance(model, torchvision.models.ResNet) else "features.5"
    expected = captum(captum_attr.LayerGradientXActivation, model, model.get_submodule(layer)).attribute(
        x, target=target
    )
    torch.testing.assert_close(InputXGradient(model, layer=layer)(x, target), expected, **TIGHT)


# -- 1-D inputs: captum takes a batch of scalars, and so does every method here ------------------------------------
SCALAR_METHODS = {
    "Saliency": (lambda m: Saliency(m, abs=False), lambda m: captum_attr.Saliency(m), {"abs": False}),
    "InputXGradient": (InputXGradient, captum_attr.InputXGradient, {}),
    "IntegratedGradients": (
        lambda m: IntegratedGradients(m, steps=5, method="riemann_middle"),
        captum_attr.IntegratedGradients,
        {"n_steps": 5, "method": "riemann_middle"},
    ),
    "GuidedBackprop": (GuidedBackprop, captum_attr.GuidedBackprop, {}),
    "Deconvolution": (Deconvolution, captum_attr.Deconvolution, {}),
}


@pytest.mark.filterwarnings("ignore:.*are all zero")
@pytest.mark.filterwarnings("ignore:.*the model has no ReLU")  # the modified-ReLU methods on the polynomials
@pytest.mark.parametrize("name", sorted(SCALAR_METHODS))
@pytest.mark.parametrize("model", [ScalarPolynomials, ScalarReLUs])
def test_a_batch_of_scalars_matches_captum(name, model):
    ours, theirs, options = SCALAR_METHODS[name]
    model = model().eval()
    with float64_default():
        expected = captum(theirs, model).attribute(scalars(), target=SCALAR_TARGETS, **options)
    got = ours(model)(scalars(), SCALAR_TARGETS)
    assert got.shape == (3,)
    torch.testing.assert_close(got, expected.detach(), **STEP_SIZES_IN_FLOAT32)


@pytest.mark.filterwarnings("ignore:SmoothGrad. items")
def test_smoothgrad_of_a_batch_of_scalars_matches_captum_without_noise():
    """Each item's range is 0, so the relative noise is 0: captum's NoiseTunnel with ``stdevs=0``."""
    model = ScalarPolynomials()
    tunnel = captum_attr.NoiseTunnel(captum(captum_attr.Saliency, model))
    expected = tunnel.attribute(scalars(), nt_type="smoothgrad", nt_samples=4, stdevs=0.0, target=SCALAR_TARGETS)
    got = SmoothGrad(Saliency(model), samples=4, noise=0.2, seed=0)(scalars(), SCALAR_TARGETS)
    torch.testing.assert_close(got, expected, **TIGHT)


@pytest.mark.parametrize("method", ["LayerGradientXActivation", "LayerIntegratedGradients"])
def test_layer_variants_on_a_batch_of_scalars_match_captum(method):
    model = ScalarPolynomials()
    with float64_default():
        expected = captum(getattr(captum_attr, method), model, model.scale).attribute(scalars(), target=SCALAR_TARGETS)
    ours = InputXGradient if method == "LayerGradientXActivation" else IntegratedGradients
    got = ours(model, layer="scale")(scalars(), SCALAR_TARGETS)
    torch.testing.assert_close(got, expected.detach(), **STEP_SIZES_IN_FLOAT32)
