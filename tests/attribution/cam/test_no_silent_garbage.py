"""CAMs never hand back a map that looks like one but is an artefact: degenerate, NaN, zero-head and uint8 cases."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from attribution import GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


def _named_layers(message: str) -> list[str]:
    return re.findall(r"'([\w.]+)'", message.split("Choose", 1)[-1].split("e.g.", 1)[-1])


@pytest.fixture(scope="module")
def vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=3, img_size=64).eval()


def test_hirescam_at_a_block_output_that_feeds_a_layernorm_warns_and_names_working_layers(vit):
    x = torch.randn(2, 3, 64, 64)
    with pytest.warns(
        UserWarning, match=r"HiResCAM map at `layer` 'blocks.1' is degenerate for items \[0, 1\]"
    ) as seen:
        raw = HiResCAM(vit, "blocks.1")(x, 1, normalize=False, upsample=False)
    message = next(m for m in _messages(seen) if "degenerate" in m)
    suggested = _named_layers(message)
    assert suggested == ["blocks.1.norm1", "blocks.1.mlp"]
    modules = dict(vit.named_modules())
    assert all(name in modules for name in suggested)  # every suggestion is a module of the model
    # the map really is rounding: tiny next to its own terms
    assert float(raw.max()) < 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in suggested:
            assert float(HiResCAM(vit, layer)(x, 1).amax()) == 1.0


def test_a_healthy_cnn_map_does_not_warn(tiny_cnn):
    torch.manual_seed(1)
    x = torch.rand(3, 3, 12, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in (GradCAM, XGradCAM, HiResCAM, LayerCAM, GradCAMPlusPlus):
            method(tiny_cnn, "features.2")(x, 0)


class Negative(nn.Module):
    """A 1x1 conv whose output is positive and whose only path to the score has a negative weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)
        self.head = nn.Linear(2, 2)
        with torch.no_grad():
            self.conv.weight.fill_(1.0)
            self.conv.bias.fill_(1.0)
            self.head.weight.copy_(torch.tensor([[-1.0, -2.0], [1.0, 2.0]]))
            self.head.bias.zero_()

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def test_evidence_only_against_the_target_warns_that_the_map_is_all_zero():
    model = Negative().eval()
    x = torch.rand(2, 1, 4, 6)
    with pytest.warns(
        UserWarning,
        match=r"GradCAM map at `layer` 'conv' is all zero for items \[0, 1\].*evidence is against the target",
    ):
        maps = GradCAM(model, "conv")(x, 0)
    assert torch.equal(maps, torch.zeros_like(maps))
    with warnings.catch_warnings():  # the other class: positive evidence, no warning
        warnings.simplefilter("error")
        assert float(GradCAM(model, "conv")(x, 1).amax()) == 1.0


def test_nan_pixel_gives_a_nan_map_for_that_item_only_and_a_warning(tiny_cnn):
    x = torch.rand(3, 3, 10, 14)
    x[1, 0, 2, 3] = float("nan")
    with pytest.warns(UserWarning, match=r"NaN or inf for item 1: their maps are NaN"):
        maps = GradCAM(tiny_cnn, "features.2")(x, 0)
    assert bool(maps[1].isnan().all())
    assert bool(torch.isfinite(maps[[0, 2]]).all())
    clean = GradCAM(tiny_cnn, "features.2")(x[[0, 2]], 0)
    torch.testing.assert_close(maps[[0, 2]], clean)


def test_zero_initialised_head_says_so_not_token_mixing():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3
    ).eval()  # torchvision zero-initialises the head, as vit_b_16(weights=None)
    with pytest.warns(UserWarning, match="last layer has all-zero weights") as seen:
        GradCAM(vit, "encoder.layers.encoder_layer_1.ln_1")(torch.randn(1, 3, 32, 32), 0)
    assert not any("token mixing" in m for m in _messages(seen))
    nn.init.normal_(vit.heads.head.weight, std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradCAM(vit, "encoder.layers.encoder_layer_1.ln_1")(torch.randn(1, 3, 32, 32), 0)


def test_after_the_last_token_mixing_suggests_only_existing_layers_before_it():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3
    ).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.1)
    with pytest.warns(UserWarning, match="after the last token mixing") as seen:
        GradCAM(vit, "encoder.layers.encoder_layer_1.ln_2")(torch.randn(1, 3, 32, 32), 0)
    suggested = _named_layers(next(m for m in _messages(seen) if "token mixing" in m))
    assert suggested == ["encoder.layers.encoder_layer_1.ln_1", "encoder.layers.encoder_layer_0.mlp"]


@pytest.mark.parametrize("shape", [(3, 20, 28), (2, 3, 20, 28)])
def test_uint8_images_get_told_how_to_convert(tiny_cnn, shape):
    images = torch.randint(0, 256, shape, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"torch.uint8 images of shape .*images.float\(\) / 255"):
        GradCAM(tiny_cnn, "features.2")(images)
