"""The CAMs and the gradient methods give the plain model's maps on a vision model whose weights accelerate offloads.

``accelerate.cpu_offload`` keeps every weight on ``meta`` outside the forward and loads each module's weights just
before it runs; the maps must equal the plain model's (the same operations: bitwise here, asserted at 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch

import attribution as A
from tests.support import hook_state

accelerate = pytest.importorskip("accelerate")

METHODS = {
    "GradCAM": lambda m: A.GradCAM(m, "layer4"),
    "GradCAMPlusPlus": lambda m: A.GradCAMPlusPlus(m, "layer3"),
    "LayerCAM": lambda m: A.LayerCAM(m, "layer2"),
    "ScoreCAM": lambda m: A.ScoreCAM(m, "layer4"),
    "Saliency": lambda m: A.Saliency(m),
    "InputXGradient": lambda m: A.InputXGradient(m),
    "IntegratedGradients": lambda m: A.IntegratedGradients(m, steps=4),
    "GuidedBackprop": lambda m: A.GuidedBackprop(m),
}


@pytest.fixture(scope="module")
def pair():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(weights=None, num_classes=7).eval()
    offloaded = accelerate.cpu_offload(copy.deepcopy(plain), execution_device=torch.device("cpu"))
    assert offloaded.fc.weight.device.type == "meta"
    return plain, offloaded


@pytest.mark.parametrize("method", list(METHODS))
def test_offloaded_vision_model_gives_the_plain_maps(pair, method):
    plain, offloaded = pair
    images = torch.randn(2, 3, 40, 56)
    before = hook_state(offloaded), [p.requires_grad for p in offloaded.parameters()]
    expected = METHODS[method](plain)(images, target=[1, 4])
    got = METHODS[method](offloaded)(images, target=[1, 4])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    assert (hook_state(offloaded), [p.requires_grad for p in offloaded.parameters()]) == before
    assert offloaded.fc.weight.device.type == "meta"
