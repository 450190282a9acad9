"""A model whose modules are not found by name is read through one explicit layout, the same in every family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attribution as A
from attribution.models import lm_layout

transformers = pytest.importorskip("transformers")


class Renamed(nn.Module):
    """A Llama under other names: ``decoder`` for ``model``, ``head`` for ``lm_head``; no HF getters, no config."""

    def __init__(self, llama: nn.Module) -> None:
        super().__init__()
        self.decoder, self.head = llama.model, llama.lm_head

    def forward(self, input_ids: torch.Tensor, **kwargs):
        hidden = self.decoder(input_ids=input_ids, **kwargs).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(hidden))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config).double().eval()
    renamed = Renamed(llama)
    layout = lm_layout(renamed, layers="decoder.layers", final_norm="decoder.norm", unembed="head",
                       embed="decoder.embed_tokens", n_heads=4, n_kv_heads=2)  # fmt: skip
    return llama, renamed, layout


IDS = torch.tensor([[3, 14, 15, 9, 2]])
CORRUPTED = torch.tensor([[3, 8, 15, 9, 2]])


def metric(out):
    return out.logits[0, -1, 4] - out.logits[0, -1, 7]


def test_the_reader_refuses_without_names_and_says_which_keyword(models):
    _, renamed, _ = models
    with pytest.raises(ValueError, match=r"could not find the decoder layers.*pass `layers="):
        lm_layout(renamed)


def test_attnlrp_with_an_explicit_layout(models):
    llama, renamed, layout = models
    expected = A.AttnLRP(llama)(IDS, target=5)
    torch.testing.assert_close(A.AttnLRP(renamed, layout=layout)(IDS, target=5), expected, rtol=1e-12, atol=0)


def test_relp_and_circuits_with_an_explicit_layout(models):
    llama, renamed, layout = models

    def relp(model, prefix, **kw):
        return A.attribution_patching(model, IDS, CORRUPTED, f"{prefix}.layers.*.mlp", metric, rules="relp", **kw)

    torch.testing.assert_close(relp(renamed, "decoder", layout=layout), relp(llama, "model"), rtol=1e-12, atol=0)
    edges = A.edge_attribution(renamed, IDS, CORRUPTED, metric, rules="relp", layout=layout, progress=False)
    plain = A.edge_attribution(llama, IDS, CORRUPTED, metric, rules="relp", progress=False)
    torch.testing.assert_close(edges.scores, plain.scores, rtol=1e-12, atol=0, equal_nan=True)
