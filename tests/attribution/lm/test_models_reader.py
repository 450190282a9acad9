"""The reader's MLP parts, norms, cache keyword and ViT layout; the weight accessor on offloaded and meta modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.models import cache_keyword, linear, lm_layout, vit_layout, weight
from tests.attribution.lm.test_lm_layout import build

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("kind", "mlp_kind", "up", "down", "act", "gate"),
    [
        ("llama", "gated", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "mlp.gate_proj"),
        ("gemma", "gated", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "mlp.gate_proj"),
        ("qwen3", "gated", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "mlp.gate_proj"),
        ("gpt2", "plain", "mlp.c_fc", "mlp.c_proj", "mlp.act", None),
        ("neox", "plain", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h", "mlp.act", None),
        ("phi", "plain", "mlp.fc1", "mlp.fc2", "mlp.activation_fn", None),
    ],
)
def test_mlp_parts_and_the_neuron_site(kind, mlp_kind, up, down, act, gate):
    model = build(kind)
    layout = lm_layout(model)
    prefix = layout.layers[1].module
    parts = layout.layers[1].mlp_parts
    assert parts is not None and parts.kind == mlp_kind
    assert (parts.up, parts.down, parts.act) == (f"{prefix}.{up}", f"{prefix}.{down}", f"{prefix}.{act}")
    assert parts.gate == (f"{prefix}.{gate}" if gate else None)
    assert parts.neurons == parts.down
    seen = {}
    handle = model.get_submodule(parts.neurons).register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    try:
        model(torch.tensor([[1, 2, 3]]))
    finally:
        handle.remove()
    hidden = model.get_submodule(parts.up)
    width = hidden.out_features if isinstance(hidden, nn.Linear) else hidden.nf  # GPT-2's Conv1D
    assert seen["x"].shape[-1] == width, "the neuron site's input is the MLP's hidden width"


def test_mlp_parts_follow_an_override():
    layout = lm_layout(build("llama"), children={"act": "up_proj"})
    assert layout.layers[0].mlp_parts.act == "model.layers.0.mlp.up_proj"


def test_norms_are_every_layer_norm_and_rms_norm_in_model_order():
    layout = lm_layout(build("gpt2"))
    assert [name for name, _ in layout.norms] == [
        "transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.h.1.ln_2",
        "transformer.ln_f",
    ]  # fmt: skip
    assert {kind for _, kind in layout.norms} == {"layer"}
    qwen3 = lm_layout(build("qwen3"))  # q_norm and k_norm inside the attention are norms too
    assert "model.layers.0.self_attn.q_norm" in dict(qwen3.norms) and set(dict(qwen3.norms).values()) == {"rms"}


def test_cache_keyword_and_softcap():
    llama = build("llama")
    assert cache_keyword(llama) in ("past_key_values", "cache") and lm_layout(llama).takes_past_key_values
    assert cache_keyword(nn.Linear(2, 2)) is None
    assert lm_layout(build("gemma2")).softcap == 30.0 and lm_layout(llama).softcap is None


def test_vit_layout_torchvision():
    torchvision = pytest.importorskip("torchvision")
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                                               hidden_dim=8, mlp_dim=16)  # fmt: skip
    layout = vit_layout(vit)
    assert (layout.kind, layout.patch_embed, layout.tokens) == ("torchvision", "conv_proj", "encoder.layers")
    assert layout.blocks[1].attention == "encoder.layers.encoder_layer_1.self_attention"
    assert layout.blocks[1].act == "encoder.layers.encoder_layer_1.mlp.1" and layout.blocks[1].qkv is None
    with pytest.raises(TypeError, match=r"expected a Vision Transformer.*got Linear"):
        vit_layout(nn.Linear(2, 2))


def test_weight_of_a_plain_module_is_the_parameter_itself():
    layer = nn.Linear(3, 2)
    assert weight(layer).data_ptr() == layer.weight.data_ptr() and not weight(layer).requires_grad
    W, b = linear(layer)
    assert W.data_ptr() == layer.weight.data_ptr() and b.data_ptr() == layer.bias.data_ptr()
    conv1d = transformers.pytorch_utils.Conv1D(2, 3)  # GPT-2's (in, out) weight
    assert torch.equal(linear(conv1d)[0], conv1d.weight.T)
    assert weight(nn.Linear(3, 2, bias=False), "bias") is None


def test_weight_of_an_offloaded_module_is_loaded_then_released():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    expected = model[1].weight.detach().clone()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model[1].weight.device.type == "meta"
    got = weight(model[1], device=torch.device("cpu"))
    assert torch.equal(got, expected) and got.device.type == "cpu"
    assert model[1].weight.device.type == "meta", "released after the read"
    torch.testing.assert_close(linear(model[1])[1], model[1]._hf_hook.weights_map["bias"])


def test_weight_on_meta_without_a_loader_is_refused():
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"meta device and no accelerate hook loads it.*load them"):
        weight(layer)
