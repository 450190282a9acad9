"""Rollout refuses what it cannot chain (windows, changing token sets), works under checkpointing, warns on zeros."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from attribution import AttentionRollout, GradientRollout

timm = pytest.importorskip("timm")


def _model(name: str, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=3, **kw).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("swin_tiny_patch4_window7_224", {"embed_dim": 24, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1)}),
        ("maxvit_tiny_tf_224", {"img_size": 64}),
    ],
)
def test_windowed_attention_gets_a_clear_error_with_a_layer_that_exists(name, kw):
    model = _model(name, **kw)
    for method in (AttentionRollout, GradientRollout):
        with pytest.raises(ValueError, match=r"within windows.*global token attention") as caught:
            method(model)(
                torch.randn(2, 3, *model.default_cfg["input_size"][1:]) if "swin" in name else torch.randn(2, 3, 64, 64)
            )
        stage = re.search(r"GradCAM\(model, '([\w.]+)'\)", str(caught.value))[1]
        assert stage in dict(model.named_modules())


def test_changing_token_sets_name_the_layers_that_work():
    model = _model("convit_tiny", img_size=32, patch_size=8, embed_dim=16, num_heads=2, depth=3, local_up_to_layer=1)
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"change size between layers.*last 17 tokens only") as caught:
        AttentionRollout(model, layers="blocks.*.attn.attn_drop")(x)
    named = re.findall(r"'(blocks\.\d+\.attn\.attn_drop)'", str(caught.value).split("only:")[1])
    assert named == ["blocks.1.attn.attn_drop", "blocks.2.attn.attn_drop"]
    assert AttentionRollout(model, layers=named)(x).shape == (2, 4, 4)


def test_gradient_rollout_under_gradient_checkpointing_equals_without():
    model = _model("vit_tiny_patch16_224", img_size=32, depth=3, embed_dim=24, num_heads=2).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = GradientRollout(model)(x, [0, 2])
    model.set_grad_checkpointing(True)
    model.train()  # timm checkpoints only in training mode; the call runs in eval mode and puts it back
    try:
        got = GradientRollout(model)(x, [0, 2])
    finally:
        model.set_grad_checkpointing(False)
    assert model.training
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradient_rollout_of_a_zero_head_warns_with_the_cause():
    model = _model("vit_tiny_patch16_224", img_size=32, depth=2, embed_dim=24, num_heads=2)
    torch.nn.init.zeros_(model.head.weight)
    with pytest.warns(UserWarning, match=r"all zero for items \[0, 1\].*last layer has all-zero weights"):
        relevance = GradientRollout(model)(torch.randn(2, 3, 32, 32), 0)
    assert not relevance.any()
    torch.nn.init.normal_(model.head.weight, std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GradientRollout(model)(torch.randn(2, 3, 32, 32), 0).amax() > 0
