"""lm_layout finds every module of the HF families by name, reads norms exactly, and names what it cannot find."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.models import lm_layout, norm_affine

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=40, n_positions=16)
    elif kind == "neox":
        config = transformers.GPTNeoXConfig(**SIZES, intermediate_size=64)
    elif kind == "phi":
        config = transformers.PhiConfig(**SIZES, intermediate_size=64)
    else:
        cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma": "GemmaConfig",
               "gemma2": "Gemma2Config", "qwen3": "Qwen3Config"}[kind]  # fmt: skip
        config = getattr(transformers, cls)(**SIZES, num_key_value_heads=2, intermediate_size=64, head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("kind", "out_proj", "qkv", "norm", "unembed", "kv", "parallel"),
    [
        ("llama", "model.layers.1.self_attn.o_proj", None, "model.norm", "lm_head", 2, False),
        ("qwen2", "model.layers.1.self_attn.o_proj", None, "model.norm", "lm_head", 2, False),
        ("qwen3", "model.layers.1.self_attn.o_proj", None, "model.norm", "lm_head", 2, False),
        ("mistral", "model.layers.1.self_attn.o_proj", None, "model.norm", "lm_head", 2, False),
        ("gemma", "model.layers.1.self_attn.o_proj", None, "model.norm", "lm_head", 2, False),
        ("gpt2", "transformer.h.1.attn.c_proj", "transformer.h.1.attn.c_attn", "transformer.ln_f", "lm_head", 4, False),
        (
            "neox",
            "gpt_neox.layers.1.attention.dense",
            "gpt_neox.layers.1.attention.query_key_value",
            "gpt_neox.final_layer_norm",
            "lm_head",
            4,
            True,
        ),
        ("phi", "model.layers.1.self_attn.dense", None, "model.final_layernorm", "lm_head", 4, True),
    ],
)
def test_families(kind, out_proj, qkv, norm, unembed, kv, parallel):
    model = build(kind)
    layout = lm_layout(model)
    modules = dict(model.named_modules())
    last = layout.layers[-1]
    assert len(layout.layers) == 2 and [layer.index for layer in layout.layers] == [0, 1]
    assert last.attention.out_proj == out_proj
    assert last.attention.qkv == qkv
    if qkv is None:
        assert last.attention.q.endswith("q_proj") and last.attention.v.endswith("v_proj")
    assert (layout.final_norm, layout.unembed, layout.n_heads, layout.n_kv_heads) == (norm, unembed, 4, kv)
    assert last.parallel is parallel and last.sandwich is False
    assert modules[layout.embed] is model.get_input_embeddings()
    for name in (last.module, last.mlp, last.attention.module, last.attn_norm, layout.final_norm):
        assert name in modules
    assert (last.mlp_norm is None) == (kind == "phi")


def test_position_embedding_and_qkv_order():
    gpt2 = lm_layout(build("gpt2"))
    assert gpt2.position == "transformer.wpe" and gpt2.layers[0].attention.qkv_order == "blocks"
    assert lm_layout(build("neox")).layers[0].attention.qkv_order == "per_head"
    llama = lm_layout(build("llama"))
    assert llama.position is None and llama.layers[0].attention.qkv_order == "separate"
    assert (llama.head_dim, llama.hidden, llama.group_size) == (8, 32, 2)


def test_gemma2_is_marked_sandwich_with_its_feedforward_norm():
    layout = lm_layout(build("gemma2"))
    assert layout.layers[0].sandwich
    assert layout.layers[0].mlp_norm == "model.layers.0.pre_feedforward_layernorm"


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 8)
        self.stack = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


def test_unknown_architecture_names_what_was_looked_for():
    with pytest.raises(ValueError, match=r"decoder layers.*model\.layers.*pass `layers="):
        lm_layout(Odd())
    with pytest.raises(ValueError, match=r"attention module in 'stack\.0'.*self_attn.*children="):
        lm_layout(Odd(), layers="stack")
    with pytest.raises(ValueError, match=r"`layers` 'nope' is not an nn.ModuleList"):
        lm_layout(Odd(), layers="nope")


def test_overrides_win():
    model = build("llama")
    layout = lm_layout(model, final_norm="model.layers.1.input_layernorm", unembed="model.embed_tokens")
    assert (layout.final_norm, layout.unembed) == ("model.layers.1.input_layernorm", "model.embed_tokens")
    with pytest.raises(ValueError, match="must divide"):
        lm_layout(model, n_heads=4, n_kv_heads=3)


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt2", "neox"])
def test_norm_affine_reproduces_the_norm_and_freezes_its_scale(kind):
    model = build(kind).double()
    layout = lm_layout(model)
    norm = dict(model.named_modules())[layout.final_norm]
    with torch.no_grad():
        for p in norm.parameters():  # non-trivial gain and shift, both signs
            p.copy_(torch.linspace(-1.5, 2.0, p.numel(), dtype=p.dtype).view_as(p))
    x = torch.randn(3, 5, 32, dtype=torch.float64) * 3 + 1
    reading = norm_affine(norm, x)
    shift = 0 if reading.shift is None else reading.shift
    torch.testing.assert_close(reading.frozen(x, reading.scale(x)) + shift, norm(x).double(), rtol=1e-6, atol=1e-6)
    # linear at a frozen scale: the parts of a sum add up to the whole
    a, b = torch.randn_like(x), torch.randn_like(x)
    s = reading.scale(a + b)
    torch.testing.assert_close(reading.frozen(a, s) + reading.frozen(b, s), reading.frozen(a + b, s))
    assert reading.centred is (kind in ("gpt2", "neox"))


def test_norm_affine_refuses_an_unknown_norm():
    class Halve(nn.Module):
        weight = None

        def forward(self, x):
            return x / 2

    with pytest.raises(ValueError, match="neither a LayerNorm nor an RMSNorm"):
        norm_affine(Halve(), torch.randn(2, 8))
