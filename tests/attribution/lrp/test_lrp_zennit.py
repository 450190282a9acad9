"""LRP against zennit 1.0, live: the same composite with zennit's canonizers, float64, to about 1e-15.

The relevance at the output is the one-hot target times the output in both (zennit: ``attr_output=one_hot * out``).
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch import nn

from attribution import lrp
from attribution.lrp import LRP, Composite, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat

torchvision = pytest.importorskip("torchvision")
zennit_composites = pytest.importorskip("zennit.composites")
zennit_attribution = pytest.importorskip("zennit.attribution")
zennit_rules = pytest.importorskip("zennit.rules")
zennit_torchvision = pytest.importorskip("zennit.torchvision")

pytestmark = pytest.mark.peers

# zennit 0.5.1 (the newest release on PyPI) merges a batch norm into the layer before it but leaves the batch norm's
# eps: the "identity" left behind computes x / sqrt(1 + eps) (its MergeBatchNorm.merge_batch_norm). zennit's
# repository zeroes eps since (and, for PyTorch >= 2.10, sets var = eps = 0.5: zennit#234, #240). Against 0.5.1 the
# cases with batch norms differ by about 1e-3, so they are compared only against a zennit newer than 0.5.1.
_ZENNIT = tuple(int(p) for p in importlib.metadata.version("zennit").split(".")[:3] if p.isdigit())
BATCH_NORMS_MERGED = _ZENNIT > (0, 5, 1)
needs_merged_batch_norms = pytest.mark.skipif(
    not BATCH_NORMS_MERGED,
    reason="zennit 0.5.1 leaves a merged batch norm's eps (x / sqrt(1 + eps)); a newer zennit zeroes it",
)

LOW, HIGH = -2.5, 3.0
COMPOSITES = {
    "EpsilonPlusFlat": (EpsilonPlusFlat, lambda c: zennit_composites.EpsilonPlusFlat(canonizers=c)),
    "EpsilonPlus": (EpsilonPlus, lambda c: zennit_composites.EpsilonPlus(canonizers=c)),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, lambda c: zennit_composites.EpsilonAlpha2Beta1(canonizers=c)),
    "EpsilonGammaBox": (
        lambda: EpsilonGammaBox(LOW, HIGH),
        lambda c: zennit_composites.EpsilonGammaBox(low=LOW, high=HIGH, canonizers=c),
    ),
}


def _randomise_batch_norms(model: nn.Module) -> nn.Module:
    """Batch norms that do something (fresh ones are the identity in eval mode), and non-zero biases."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.copy_(torch.rand(module.num_features, generator=generator) - 0.5)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            module.bias.data.copy_(torch.rand(module.num_features, generator=generator) - 0.5)
        elif isinstance(module, (nn.Conv2d, nn.Linear)) and module.bias is not None:
            module.bias.data.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model


def _vgg(batch_norm: bool) -> nn.Module:
    """torchvision's VGG class, narrow: 3 stages of 8-32 channels, a 16-unit classifier, 5 classes."""
    from torchvision.models.vgg import VGG, make_layers

    torch.manual_seed(0)
    model = VGG(make_layers([8, "M", 16, 16, "M", 32, 32, "M"], batch_norm=batch_norm), num_classes=5)
    model.avgpool = nn.AdaptiveAvgPool2d(2)
    model.classifier = nn.Sequential(
        nn.Linear(32 * 2 * 2, 16), nn.ReLU(True), nn.Dropout(), nn.Linear(16, 16), nn.ReLU(True), nn.Linear(16, 5)
    )
    return _randomise_batch_norms(model).double().eval()


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return _randomise_batch_norms(torchvision.models.resnet18(num_classes=5)).double().eval()


def _zennit(model: nn.Module, composite: object, x: torch.Tensor, target: list[int]) -> torch.Tensor:
    out = model(x)
    one_hot = torch.zeros_like(out)
    one_hot[torch.arange(len(target)), target] = 1.0
    with zennit_attribution.Gradient(model, composite) as attributor:
        _, relevance = attributor(x, lambda output: one_hot * output)
    return relevance


def _check(model: nn.Module, name: str, canonizer: type, x: torch.Tensor) -> None:
    ours, theirs = COMPOSITES[name]
    target = [1, 3][: x.shape[0]]
    expected = _zennit(model, theirs([canonizer()]), x, target)
    got = LRP(model, ours())(x, target=target)
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14 * float(expected.abs().max()))


@pytest.mark.parametrize("name", list(COMPOSITES))
@pytest.mark.parametrize("batch_norm", [False, True], ids=["vgg", "vgg_bn"])
def test_vgg_matches_zennit(name: str, batch_norm: bool) -> None:
    if batch_norm and not BATCH_NORMS_MERGED:
        pytest.skip("zennit 0.5.1 leaves a merged batch norm's eps (x / sqrt(1 + eps)); a newer zennit zeroes it")
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _check(_vgg(batch_norm), name, zennit_torchvision.VGGCanonizer, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSITES))
@needs_merged_batch_norms
def test_resnet18_matches_zennit(name: str) -> None:
    x = torch.randn(2, 3, 32, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _check(_resnet18(), name, zennit_torchvision.ResNetCanonizer, x)


@pytest.mark.slow
@needs_merged_batch_norms
def test_resnet18_one_image_matches_zennit() -> None:
    """The fast check of the ResNet canonization (skip sums, downsample branches, merged batch norms)."""
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _check(_resnet18(), "EpsilonPlusFlat", zennit_torchvision.ResNetCanonizer, x)


class _BatchNormReLU6(nn.BatchNorm2d):
    """A batch norm with its activation inside (as timm's BatchNormAct2d, without children)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu6(super().forward(x))


@needs_merged_batch_norms
def test_grouped_strided_dilated_convs_pools_and_activations_match_zennit() -> None:
    """Conv options the VGG lacks, a batch norm with an activation inside it, ELU (Pass), average pooling (Norm)."""
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv2d(3, 6, (3, 2), stride=(2, 1), padding=(1, 0)),
        _BatchNormReLU6(6),
        nn.Conv2d(6, 4, 3, dilation=2, groups=2, bias=False),
        nn.BatchNorm2d(4),
        nn.ELU(),
        nn.AvgPool2d(2),
        nn.Conv2d(4, 4, 1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 1 * 2, 5),
    )
    model = _randomise_batch_norms(model).double().eval()
    canonizers = pytest.importorskip("zennit.canonizers")
    x = torch.randn(2, 3, 13, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for name in COMPOSITES:
        _check(model, name, canonizers.SequentialMergeBatchNorm, x)


@pytest.mark.parametrize("rule", ["WSquare", "Flat"])
def test_a_relu_under_a_composite_of_ones_own_gets_zennits_pass(rule: str) -> None:
    """zennit passes every activation (ReLU included) in its composites: so do ours, also a user's ``Composite``."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(3, 3, dtype=torch.float64)
    assert bool((model[:2](x) == 0).any()), "some ReLU outputs must be 0 for the check to mean something"
    theirs = zennit_composites.LayerMapComposite(
        [*zennit_composites.layer_map_base(), (nn.Linear, getattr(zennit_rules, rule)())]
    )
    expected = _zennit(model, theirs, x, [0, 1, 1]).detach()
    ours = getattr(lrp, rule)()
    for composite in (Composite([(nn.Linear, ours)]), EpsilonPlus(layer_map=[(nn.Linear, ours)])):
        got = LRP(model, composite)(x, target=[0, 1, 1])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14 * float(expected.abs().max()))
