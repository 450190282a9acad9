"""Sites: keyword and element sites, other threads, and records that later in-place operations cannot change."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from attribution import patch, record
from tests.attribution.models import tiny_llama


def test_input_site_reaches_keyword_only_arguments_and_can_name_them():
    model = tiny_llama(hidden_size=16, intermediate_size=32, num_attention_heads=2, max_position_embeddings=32)
    tokens = torch.randint(0, 50, (2, 5))
    site = "model.layers.0.self_attn"  # called as self_attn(hidden_states=..., ...): no positional argument
    with (
        record(model, site, site="input") as first,
        record(model, site, site="input", element="hidden_states") as named,
        record(model, "model.layers.0.input_layernorm") as norm,
        torch.no_grad(),
    ):
        logits = model(tokens).logits
    assert torch.equal(first[site], norm["model.layers.0.input_layernorm"])
    assert torch.equal(named[site], first[site])
    with patch(model, {site: torch.zeros(2, 5, 16)}, site="input"), torch.no_grad():
        patched = model(tokens).logits
    assert not torch.allclose(patched, logits)
    with pytest.raises(ValueError, match=r"`element`='states', but 'model.layers.0.self_attn' was called without"):
        with record(model, site, site="input", element="states"), torch.no_grad():
            model(tokens)


def test_record_and_patch_read_model_output_elements_by_index_and_name():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    bert = transformers.BertModel(config, add_pooling_layer=False).eval()
    tokens = torch.randint(0, 50, (2, 6))
    with (
        record(bert, "encoder", element="last_hidden_state") as by_name,
        record(bert, "encoder", element=0) as by_index,
        torch.no_grad(),
    ):
        out = bert(tokens)
    assert torch.equal(by_name["encoder"], out.last_hidden_state)
    assert torch.equal(by_index["encoder"], out.last_hidden_state)
    with patch(bert, {"encoder": targets_zero(element="last_hidden_state")}), torch.no_grad():
        patched = bert(tokens)
    assert type(patched.last_hidden_state) is torch.Tensor and torch.equal(
        patched.last_hidden_state, torch.zeros(2, 6, 16)
    )


def targets_zero(element):
    from attribution import Patch

    return Patch(lambda a: a * 0, element=element)


def test_threads_all_records_and_patches_forwards_of_other_threads(tiny_cnn):
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        clean = tiny_cnn(x)
    with ThreadPoolExecutor(1) as pool:
        with record(tiny_cnn, "features.2") as mine, torch.no_grad():
            pool.submit(tiny_cnn, x).result()
        assert "features.2" not in mine  # "current": the worker's forward is not this thread's
        with record(tiny_cnn, "features.2", threads="all") as everyone, torch.no_grad():
            pool.submit(tiny_cnn, x).result()
        assert everyone["features.2"].shape == (2, 16, 8, 8)
        with patch(tiny_cnn, {"features.3": lambda a: a * 0}, threads="all"), torch.no_grad():
            out = pool.submit(tiny_cnn, x).result()
        torch.testing.assert_close(out, tiny_cnn.fc.bias.expand(2, -1))
        with torch.no_grad():
            torch.testing.assert_close(pool.submit(tiny_cnn, x).result(), clean)
    assert threading.active_count() >= 1


def test_record_keeps_a_copy_that_later_in_place_operations_cannot_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = model[0](x).detach()
    assert (expected < 0).any()  # the in-place ReLU would zero these in a shared tensor
    with record(model, "0") as out, record(model, "1", site="input") as inp, torch.no_grad():
        model(x)
    assert torch.equal(out["0"], expected)
    assert torch.equal(inp["1"], expected)
