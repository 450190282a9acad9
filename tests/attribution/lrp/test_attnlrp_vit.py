"""AttnLRP on tiny random timm and torchvision ViTs: a hand-written float64 reference, LXT 2.1 (CP-LRP) parity for
torchvision, the contract (model untouched, errors, conservation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attribution._transformer_rules import scaled_attention_inputs
from attribution.lrp import AttnLRP

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
HERE = Path(__file__).resolve().parent


def _timm(reg_tokens: int = 0, **kwargs: object) -> nn.Module:
    """Two blocks, 16-pixel patches on 32 x 48 images: a 2 x 3 grid (a swapped axis changes the shape)."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=(32, 48), patch_size=16, embed_dim=16, depth=2,
        num_heads=2, num_classes=5, reg_tokens=reg_tokens, **kwargs,
    )  # fmt: skip
    for p in model.parameters():  # timm starts the class token, biases and norms at 0 / 1: make them random
        p.data = p.data + 0.3 * torch.randn_like(p)
    return model.double().eval()


def _torchvision() -> nn.Module:
    torch.manual_seed(1)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=24, num_classes=5
    )
    for p in model.parameters():
        p.data = p.data + 0.3 * torch.randn_like(p)
    return model.double().eval()


def _images(height: int = 32, width: int = 48) -> torch.Tensor:
    return torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


# -- the reference: the rules written out, by surrogate functions whose value is the forward's -------------------------
def _grad_times(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Value ``x``, gradient times ``factor``."""
    return factor * x + ((1 - factor) * x).detach()


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """The norm with its scale ``1 / std`` held constant."""
    std = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    return (x - x.mean(-1, keepdim=True)) / std.detach() * norm.weight + norm.bias


def _identity(x: torch.Tensor) -> torch.Tensor:
    """GELU with gradient ``gelu(x) / (x + 1e-10)`` (the identity rule, with LXT's epsilon)."""
    y = F.gelu(x).detach()
    return y + (x - x.detach()) * (y / (x.detach() + 1e-10))


def _attention(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, heads: int, factors: tuple[float, ...]
) -> torch.Tensor:
    """Multi-head self-attention from the packed in-projection ``w``, ``b``; q, k, v gradients scaled by ``factors``."""
    B, T, D = h.shape
    q, k, v = (_grad_times(t, f) for t, f in zip((h @ w.T + b).split(D, -1), factors, strict=True))
    q, k, v = (t.reshape(B, T, heads, D // heads).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / (D // heads) ** 0.5
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)


def _reference_timm(model: nn.Module, images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    proj = model.patch_embed.proj
    patches = F.conv2d(images, proj.weight, proj.bias, stride=16).requires_grad_(True)
    B = len(patches)
    x = patches.flatten(2).transpose(1, 2)
    prefix = [model.cls_token.expand(B, -1, -1)]
    if model.reg_token is not None:
        prefix.append(model.reg_token.expand(B, -1, -1))
    x = torch.cat([*prefix, x], 1) + model.pos_embed  # class, registers, patches; all with a position embedding
    for block in model.blocks:
        a = block.attn
        h = _attention(_layer_norm(x, block.norm1), a.qkv.weight, a.qkv.bias, a.num_heads, (0.25, 0.25, 0.5))
        x = x + a.proj(h)
        m = block.mlp
        x = x + m.fc2(_identity(m.fc1(_layer_norm(x, block.norm2))))
    logits = model.head(_layer_norm(x, model.norm)[:, 0])
    (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), patches)
    return (patches * grad).sum(1)


def _reference_torchvision(
    model: nn.Module, images: torch.Tensor, target: torch.Tensor, factors: tuple[float, ...] = (0.25, 0.25, 0.5)
) -> torch.Tensor:
    patches = F.conv2d(images, model.conv_proj.weight, model.conv_proj.bias, stride=16).requires_grad_(True)
    B = len(patches)
    x = torch.cat([model.class_token.expand(B, -1, -1), patches.flatten(2).transpose(1, 2)], 1)
    x = x + model.encoder.pos_embedding
    for block in model.encoder.layers:
        a = block.self_attention
        h = _attention(_layer_norm(x, block.ln_1), a.in_proj_weight, a.in_proj_bias, a.num_heads, factors)
        x = x + a.out_proj(h)
        x = x + block.mlp[3](_identity(block.mlp[0](_layer_norm(x, block.ln_2))))
    logits = model.heads.head(_layer_norm(x, model.encoder.ln)[:, 0])
    (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), patches)
    return (patches * grad).sum(1)


# -- known answers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reg_tokens", [0, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_timm_equals_the_rules_written_out(reg_tokens: int, fused: bool) -> None:
    model, images, target = _timm(reg_tokens), _images(), torch.tensor([3, 1])
    for block in model.blocks:
        block.attn.fused_attn = fused
    got = AttnLRP(model)(images, target=target)
    assert got.shape == (2, 2, 3)
    torch.testing.assert_close(got, _reference_timm(model, images, target), rtol=1e-12, atol=1e-14)


def test_torchvision_equals_the_rules_written_out() -> None:
    model, images, target = _torchvision(), _images(32, 32), torch.tensor([4, 0])
    got = AttnLRP(model)(images, target=target)
    assert got.shape == (2, 2, 2)
    torch.testing.assert_close(got, _reference_torchvision(model, images, target), rtol=1e-12, atol=1e-14)


def test_the_reference_is_not_the_plain_gradient() -> None:
    """Each rule matters: without the 0.25/0.5 scalings the reference moves far from AttnLRP."""
    model, images, target = _torchvision(), _images(32, 32), torch.tensor([4, 0])
    plain = _reference_torchvision(model, images, target, factors=(1.0, 1.0, 1.0))
    assert (plain - AttnLRP(model)(images, target=target)).abs().max() > 1e-3 * plain.abs().max()


def test_split_attention_inputs_keep_the_output() -> None:
    """Three views of x project separately: allclose (float64 1e-12) to the fused self-attention, and nothing else."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    args, kwargs = scaled_attention_inputs((x, x, x), {"need_weights": False}, (0.25, 0.25, 0.5))
    expected = attention(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(attention(*args, **kwargs)[0], expected, rtol=1e-12, atol=1e-14)
    args, kwargs = scaled_attention_inputs((x,), {"key": x, "value": x}, (0.25, 0.25, 0.5))
    assert len(args) == 3 and not kwargs


def test_patch_map_is_row_major_as_the_tokens() -> None:
    """Without position embedding a patch token's relevance is its patch's: the map is the tokens in the model's
    (row-major) order on the 2 x 3 grid, after the class and register tokens."""
    model = _timm(reg_tokens=2)
    with torch.no_grad():
        model.pos_embed.zero_()
    result = AttnLRP(model).attribute_image(_images(), target=[3, 1])
    assert result.patches.shape == (2, 2, 3) and result.tokens.shape == (2, 1 + 2 + 6, 16)
    torch.testing.assert_close(result.tokens[:, 3:].sum(-1), result.patches.flatten(1), rtol=1e-12, atol=1e-14)


# -- the result, conservation, targets -------------------------------------------------------------------------------
def test_tokens_and_conservation() -> None:
    model, images = _timm(reg_tokens=2), _images()
    result = AttnLRP(model).attribute_image(images, target=[3, 1])
    assert result.tokens.shape == (2, 1 + 2 + 6, 16)
    with torch.no_grad():
        logits = model(images)
    torch.testing.assert_close(result.logits, logits[[0, 1], [3, 1]])
    assert result.targets.tolist() == [3, 1]
    assert result.conservation.shape == (2,)
    assert bool(torch.isfinite(result.conservation).all())


def test_conservation_without_biases_is_exact_through_the_values() -> None:
    """No biases (LayerNorm and Linear) nor position embedding: with the attention weights held constant (CP-LRP's
    factors) every step conserves, and the tokens' relevance sums to the logit. AttnLRP's softmax rule does not
    conserve (the paper's bias term): with its factors the sum is only near the logit."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=16, embed_dim=16, depth=2, num_heads=2,
        num_classes=5, qkv_bias=False, pos_embed="none", norm_layer=lambda d, **kw: nn.LayerNorm(d, bias=False, **kw),
    ).double().eval()  # fmt: skip
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
    with torch.no_grad():
        model.cls_token.normal_()
    lrp = AttnLRP(model)
    attnlrp = lrp.attribute_image(_images(32, 32), target=None).conservation
    assert bool(((attnlrp - 1).abs() < 0.05).all()) and bool(((attnlrp - 1).abs() > 1e-8).all())
    lrp.sites.scaled = {name: torch.tensor([0.0] * 32 + [1.0] * 16) for name in lrp.sites.scaled}
    result = lrp.attribute_image(_images(32, 32), target=None)
    # 1e-10: the identity rule's epsilon (gelu(x) / (x + 1e-10)) absorbs ~1e-11 of the relevance
    torch.testing.assert_close(result.conservation, torch.ones(2, dtype=torch.float64), rtol=1e-10, atol=0)


def test_targets_as_the_cams() -> None:
    model, images = _timm(), _images()
    lrp = AttnLRP(model)
    with torch.no_grad():
        top = model(images).argmax(1)
    torch.testing.assert_close(lrp(images), lrp(images, target=top))
    torch.testing.assert_close(lrp(images, target=2), lrp(images, target=[2, 2]))
    result = lrp.attribute_image(images, target=lambda out: out[:, 1] - out[:, 0])
    assert result.targets.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="out of range"):
        lrp(images, target=5)
    with pytest.raises(ValueError, match="2 items"):
        lrp(images, target=[1, 2, 3])


# -- the contract ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [_timm, _torchvision])
def test_model_untouched_also_on_error(make: object) -> None:
    model = make()  # type: ignore[operator]
    images = _images(32, 48 if make is _timm else 32)
    model.train()

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model.eval()(images)
        out[:, 1].sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        model.train()
        return out.detach(), grads

    before = run()
    lrp = AttnLRP(model)
    lrp(images, target=1)
    with pytest.raises(ValueError, match="out of range"):
        lrp(images, target=9)
    with pytest.raises(RuntimeError):
        lrp(images[:, :2], target=1)
    after = run()
    assert torch.equal(before[0], after[0]) and all(map(torch.equal, before[1], after[1]))
    assert model.training and all(p.requires_grad for p in model.parameters())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks


def test_torchvision_output_is_allclose_to_the_unobserved_model() -> None:
    """The split attention inputs change the in-projection's matmul shapes: the output is allclose, not bitwise."""
    model, images = _torchvision(), _images(32, 32)
    with torch.no_grad():
        expected = model(images)
    assert AttnLRP(model).attribute_image(images).logits.shape == (2,)
    torch.testing.assert_close(
        AttnLRP(model).attribute_image(images, target=lambda out: out[:, 2]).logits, expected[:, 2],
        rtol=1e-12, atol=1e-14,
    )  # fmt: skip


def test_unknown_models_and_inputs_are_named() -> None:
    with pytest.raises(TypeError, match=r"timm VisionTransformer .* torchvision VisionTransformer .* got Sequential"):
        AttnLRP(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="global_pool='map'"):
        AttnLRP(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, embed_dim=16, depth=1,
                                  num_heads=2, global_pool="map"))  # fmt: skip
    lrp = AttnLRP(_timm())
    with pytest.raises(TypeError, match="`images` must be a float tensor"):
        lrp(torch.zeros(2, 32, 48))
    with pytest.raises(ValueError, match="`position` and `reduce`"):
        lrp(_images(), reduce=False)
    with pytest.raises(TypeError, match="attribute_image"):
        lrp.attribute(_images())


# -- LXT 2.1 parity: LXT's ViT (torchvision) uses CP-LRP in the attention --------------------------------------------
@pytest.mark.peers
@pytest.mark.slow
def test_torchvision_cp_lrp_equals_lxt(tmp_path: Path) -> None:
    """LXT 2.1 has torchvision ViTs only with CP-LRP in the attention (no gradient into query and key, all of it into
    value); the same factors on our sites must give LXT's numbers (LXT patches torch classes: a subprocess)."""
    pytest.importorskip("lxt")
    model, images, target = _torchvision(), _images(32, 32), torch.tensor([4, 0])
    lrp = AttnLRP(model)
    lrp.sites.attention_inputs = dict.fromkeys(lrp.sites.attention_inputs, (0.0, 0.0, 1.0))
    got = lrp(images, target=target)
    torch.save({"model": model, "images": images, "targets": target}, tmp_path / "case.pt")
    subprocess.run(
        [sys.executable, str(HERE / "_lxt_vit_reference.py"), str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        check=True,
        capture_output=True,
    )
    expected = torch.load(tmp_path / "out.pt")["relevance"]
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        got, _reference_torchvision(model, images, target, (0.0, 0.0, 1.0)), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize(
    ("name", "kwargs", "tokens"),
    [
        ("vit_tiny_patch16_224", {"class_token": False, "global_pool": "avg", "img_size": (32, 48)}, 6),
        ("deit_tiny_distilled_patch16_224", {"img_size": (32, 48)}, 2 + 6),  # class and distillation tokens
    ],
)
def test_other_timm_layouts(name: str, kwargs: dict[str, object], tokens: int) -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        name, pretrained=False, patch_size=16, embed_dim=16, depth=1, num_heads=2, num_classes=3, **kwargs
    ).eval()
    result = AttnLRP(model).attribute_image(torch.randn(2, 3, 32, 48), target=1)
    assert result.patches.shape == (2, 2, 3) and result.tokens.shape == (2, tokens, 16)
    assert bool(torch.isfinite(result.tokens).all()) and result.patches.abs().max() > 0


def test_a_gated_timm_mlp_is_refused_by_name() -> None:
    model = timm.create_model(
        "vit_small_patch16_224", pretrained=False, img_size=32, embed_dim=16, depth=1, num_heads=2,
        mlp_layer=timm.layers.SwiGLUPacked, act_layer=nn.SiLU,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"`Mlp` with an `act` module in blocks.0 .* mlp=GluMlp"):
        AttnLRP(model)


def test_upsample_resizes_the_patch_map_to_the_image() -> None:
    model, images = _timm(), _images()
    lrp = AttnLRP(model)
    patches, pixels = lrp(images, target=1), lrp(images, target=1, upsample=True)
    assert pixels.shape == (2, 32, 48)
    expected = F.interpolate(patches[:, None], size=(32, 48), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(pixels, expected)
