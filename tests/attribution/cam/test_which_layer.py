"""The layers that docs/which-layer.rst recommends give real maps with every gradient CAM, and the ones it warns
against warn (random-weight timm models at small sizes)."""

from __future__ import annotations

import warnings

import pytest
import torch

from attribution import (
    AttentionRollout,
    GradCAM,
    GradCAMPlusPlus,
    GradientRollout,
    HiResCAM,
    LayerCAM,
    XGradCAM,
    activation_patching,
    attribution_patching,
)

timm = pytest.importorskip("timm")
METHODS = (GradCAM, GradCAMPlusPlus, XGradCAM, HiResCAM, LayerCAM)
CHANNELS_LAST = "b h w c -> b c h w"

# family: (timm name, create_model options, image side, recommended layer, reshape, (layer, method) that warns)
TABLE = {
    "ViT": ("vit_tiny_patch16_224", {"img_size": 64, "depth": 4}, 64, "blocks.3.norm1", None, ("blocks.2", HiResCAM)),
    "DeiT": ("deit_tiny_distilled_patch16_224", {"img_size": 64, "depth": 4}, 64, "blocks.3.norm1", None,
             ("blocks.3", GradCAM)),
    "CaiT": ("cait_xxs24_224", {"img_size": 64, "depth": 4}, 64, "blocks.3.norm1", None, ("blocks.3", HiResCAM)),
    "Swin": ("swin_tiny_patch4_window7_224", {"embed_dim": 24, "depths": (1, 1, 1, 2), "num_heads": (1, 1, 1, 1)},
             224, "layers.3.blocks.1.norm1", CHANNELS_LAST, ("layers.3", HiResCAM)),
    "ConvNeXt": ("convnext_atto", {}, 64, "stages.3", None, ("stages.2", HiResCAM)),
    "CoAtNet": ("coatnet_0_rw_224", {}, 224, "stages.3.blocks.0", None, ("stages.3.blocks.1.norm1", GradCAM)),
    "MaxViT": ("maxvit_tiny_tf_224", {"img_size": 64}, 64, "stages.3.blocks.1.attn_grid.norm1", CHANNELS_LAST,
               ("stages.3", GradCAMPlusPlus)),
    "EfficientFormer": ("efficientformer_l1", {}, 224, "norm", None, ("stages.3", HiResCAM)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TABLE))
def test_recommended_layer_gives_real_maps_and_the_avoided_one_warns(family):
    name, options, side, layer, reshape, (avoid, method_avoided) = TABLE[family]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4, **options).eval()
    x = torch.randn(2, 3, side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in METHODS:
            maps = method(model, layer, reshape=reshape)(x)  # each item's top class
            assert torch.equal(maps.flatten(1).amax(1), torch.ones(2)), (family, method.__name__)
    with pytest.warns(UserWarning, match=r"zero|degenerate"):
        method_avoided(model, avoid, reshape=reshape if family == "Swin" else None)(x)
    _patching_and_rollout(family, model, x, layer)


def _patching_and_rollout(family: str, model: torch.nn.Module, x: torch.Tensor, layer: str) -> None:
    """Patching and AtP at the layer give finite effects; rollout works where attention is global, else says why."""

    def metric(output: torch.Tensor) -> torch.Tensor:
        return output[:, 1].sum() - output[:, 2].sum()

    corrupted = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    exact = activation_patching(model, x, corrupted, layer, metric, positions=False, progress=False)
    estimate = attribution_patching(model, x, corrupted, layer, metric, positions=False)
    assert exact.shape == estimate.shape == (1,) and bool(torch.isfinite(exact).all() & torch.isfinite(estimate).all())
    if family in ("ViT", "DeiT"):
        assert GradientRollout(model)(x, 1).shape == (2, 4, 4)
        assert AttentionRollout(model)(x).shape == (2, 4, 4)
    elif family in ("Swin", "MaxViT", "CoAtNet", "CaiT"):
        with pytest.raises(ValueError, match=r"within windows|change size between layers|not self-attention"):
            AttentionRollout(model)(x)


def _shapes_task(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise images 32x32 with a bright 6x6 square on one of the 16 patches, hollow for class 1 (the label needs the
    object, not where it is); returns images, labels and the object's patch."""
    labels = torch.randint(0, 2, (n,), generator=generator)
    cells = torch.randint(0, 16, (n,), generator=generator)
    images = torch.randn(n, 3, 32, 32, generator=generator) * 0.3
    for i in range(n):
        top, left = 8 * (int(cells[i]) // 4), 8 * (int(cells[i]) % 4)
        images[i, :, top + 1 : top + 7, left + 1 : left + 7] += 2.0
        if labels[i] == 1:
            images[i, :, top + 3 : top + 5, left + 3 : left + 5] -= 2.0
    return images, labels, cells


@pytest.mark.slow
def test_on_a_trained_tiny_vit_the_recommended_layer_points_at_the_object():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        num_classes=2,
    )  # fmt: skip
    optimiser = torch.optim.Adam(vit.parameters(), lr=2e-3)
    for _ in range(200):
        images, labels, _ = _shapes_task(64, generator)
        loss = torch.nn.functional.cross_entropy(vit(images), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    vit.eval()
    images, labels, cells = _shapes_task(64, generator)
    with torch.no_grad():
        assert (vit(images).argmax(1) == labels).float().mean() > 0.95

    def hits(maps: torch.Tensor) -> float:  # the peak lies on the object's patch
        peaks = maps.flatten(1).argmax(1)
        return float(((peaks // 32 // 8) * 4 + (peaks % 32) // 8 == cells).float().mean())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Grad-CAM's map is all zero, with a warning, for a few items
        for method, least in ((GradCAM, 0.7), (GradCAMPlusPlus, 0.8), (HiResCAM, 0.8), (LayerCAM, 0.8)):
            assert hits(method(vit, "blocks.1.norm1")(images, labels)) >= least, method.__name__
    assert hits(GradCAM(vit, "blocks.0")(images, labels)) < 0.2  # a block output: the map misses the object
    with pytest.warns(UserWarning, match="after the last token mixing"):
        GradCAM(vit, "blocks.1")(images, labels)
