"""``heads=`` is checked against the model's config: on GQA, query heads and key/value heads differ."""

from __future__ import annotations

import pytest
import torch

from attribution import activation_patching, attribution_patching, path_patching

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def metric(output):
    return output.logits[:, -1, 3].mean() - output.logits[:, -1, 5].mean()


CLEAN, CORRUPTED = torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 5))


def test_query_heads_on_the_output_projection_input_and_kv_heads_on_v_proj_work(llama):
    o = activation_patching(llama, CLEAN, CORRUPTED, "model.layers.*.self_attn.o_proj", metric, site="input",
                            heads=4, positions=False, progress=False)  # fmt: skip
    v = activation_patching(llama, CLEAN, CORRUPTED, "model.layers.*.self_attn.v_proj", metric, heads=2,
                            positions=False, progress=False)  # fmt: skip
    assert o.shape == (2, 4) and v.shape == (2, 2)


@pytest.mark.parametrize(
    ("layers", "site", "heads", "holds"),
    [
        ("model.layers.*.self_attn.v_proj", "output", 4, "2 key/value heads"),
        ("model.layers.*.self_attn.k_proj", "output", 1, "2 key/value heads"),
        ("model.layers.*.self_attn.o_proj", "input", 2, "4 query heads"),
        ("model.layers.*.self_attn.q_proj", "output", 2, "4 query heads"),
    ],
)
def test_a_mismatched_head_count_is_refused_naming_both_numbers(llama, layers, site, heads, holds):
    expected = f"`heads`={heads} does not match .* holds {holds}.*4 query heads and 2 key/value heads"
    with pytest.raises(ValueError, match=expected):
        activation_patching(llama, CLEAN, CORRUPTED, layers, metric, site=site, heads=heads, progress=False)
    with pytest.raises(ValueError, match=expected):
        attribution_patching(llama, CLEAN, CORRUPTED, layers, metric, site=site, heads=heads)
    with pytest.raises(ValueError, match=expected):
        path_patching(llama, CLEAN, CORRUPTED, layers, "model.norm", metric, site=site, heads=heads, progress=False)
