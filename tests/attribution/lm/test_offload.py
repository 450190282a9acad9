"""Every language-model method gives the plain model's numbers on the same model loaded with accelerate's offload.

A tiny HuggingFace Llama (grouped-query attention) and GPT-2 are saved to a temporary folder and reloaded with
``device_map``: two decoder layers and the LM head on disk, so their weights are on ``meta`` outside the forward
and accelerate loads them for each call. Float32 throughout; the two models compute the same operations, so the
results agree to float rounding (asserted at 1e-5 of the largest value).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import attribution as A
from attribution.circuits import Circuit
from tests.support import hook_state

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

IDS = torch.tensor([[3, 14, 15, 9, 2, 6], [3, 8, 15, 9, 2, 6]])
CLEAN, CORRUPTED = IDS[:1], IDS[1:]


def _metric(out):
    return out.logits[:, -1, 4].mean() - out.logits[:, -1, 7].mean()


def _build(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        disk = ["model.layers.1", "model.layers.2", "lm_head"]  # two layers and the LM head on disk
    else:
        config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=3, n_head=4)
        config.tie_word_embeddings = False
        model = transformers.GPT2LMHeadModel(config)
        disk = ["transformer.h.1", "transformer.h.2", "lm_head"]
    return model.eval(), disk


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    """(plain model, the same model reloaded with two layers and the LM head offloaded to disk)."""
    plain, disk = _build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    plain.save_pretrained(folder)
    base, layers = ("model", "model.layers") if request.param == "llama" else ("transformer", "transformer.h")
    device_map = {f"{base}.{name}": "cpu" for name, _ in plain.get_submodule(base).named_children()}
    device_map.pop(layers)
    device_map.update({f"{layers}.0": "cpu", **dict.fromkeys(disk, "disk")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offloaded = transformers.AutoModelForCausalLM.from_pretrained(
            folder, device_map=device_map, offload_folder=str(folder / "offload")
        ).eval()
    head = offloaded.get_output_embeddings()
    assert head.weight.device.type == "meta", "the LM head must be offloaded for this test to mean anything"
    torch.testing.assert_close(offloaded(IDS).logits, plain(IDS).logits, rtol=0, atol=1e-6)
    return request.param, plain, offloaded


def _close(a, b) -> None:
    a, b = (torch.as_tensor(t).detach().as_subclass(torch.Tensor).float() for t in (a, b))
    scale = float(b.nan_to_num().abs().max().clamp_min(1e-6))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale, equal_nan=True)


def _layers(kind: str) -> str:
    return "model.layers.*" if kind == "llama" else "transformer.h.*"


def _generation(method, kind, model):
    return A.attribute_generation(model, IDS[0, :4], generated=IDS[0, 4:], method=method, steps=4).scores


CALLS = {
    "logit_lens": lambda kind, m: A.logit_lens(m, IDS),
    "direct_logit_attribution": lambda kind, m: A.direct_logit_attribution(m, IDS, (4, 7)).values,
    "activation_patching": lambda kind, m: A.activation_patching(
        m, CLEAN, CORRUPTED, _layers(kind), _metric, progress=False
    ),
    "attribution_patching": lambda kind, m: A.attribution_patching(m, CLEAN, CORRUPTED, _layers(kind), _metric),
    "attribution_patching_relp": lambda kind, m: A.attribution_patching(
        m, CLEAN, CORRUPTED, _layers(kind), _metric, rules="relp"
    ),
    "edge_attribution": lambda kind, m: A.edge_attribution(m, CLEAN, CORRUPTED, _metric, progress=False).scores,
    "edge_attribution_ig": lambda kind, m: (
        A.edge_attribution(m, CLEAN, CORRUPTED, _metric, ig_steps=3, progress=False).scores
    ),
    "edge_attribution_relp": lambda kind, m: (
        A.edge_attribution(m, CLEAN, CORRUPTED, _metric, rules="relp", progress=False).scores
    ),
    "faithfulness": lambda kind, m: A.faithfulness(
        m, CLEAN, CORRUPTED, _metric, [Circuit([("embed", "logits"), ("a0.h1", "logits")]), Circuit()]
    ),
    "exact_edge_effects": lambda kind, m: A.exact_edge_effects(
        m, CLEAN, CORRUPTED, _metric, [("embed", "logits"), ("a0.h1", "m1"), ("m1", "logits")], progress=False
    ),
    "AttnLRP": lambda kind, m: A.AttnLRP(m)(IDS, target=5),
    "attribution_graph": lambda kind, m: A.attribution_graph(m, IDS[0], progress=False).adjacency.to_dense(),
    "attribution_graph_relp": lambda kind, m: A.attribution_graph(
        m, IDS[0], rules="relp", max_nodes=20, batch_size=8, progress=False
    ).adjacency.to_dense(),
    **{
        f"attribute_generation_{method}": functools.partial(_generation, method)
        for method in ("saliency", "input_x_gradient", "integrated_gradients", "attnlrp")
    },
}


@pytest.mark.parametrize("method", list(CALLS))
def test_offloaded_model_gives_the_plain_numbers(pair, method):
    kind, plain, offloaded = pair
    before = (hook_state(offloaded), [(p.requires_grad, p.grad) for p in offloaded.parameters()], offloaded.training)
    expected = CALLS[method](kind, plain)
    got = CALLS[method](kind, offloaded)
    _close(got, expected)
    after = (hook_state(offloaded), [(p.requires_grad, p.grad) for p in offloaded.parameters()], offloaded.training)
    assert after == before
    assert offloaded.get_output_embeddings().weight.device.type == "meta", "the weights were released after the call"


def test_path_patching_on_the_offloaded_model(pair):
    kind, plain, offloaded = pair
    prefix = "model.layers" if kind == "llama" else "transformer.h"

    def run(model):
        return A.path_patching(
            model, CLEAN, CORRUPTED, f"{prefix}.0", f"{prefix}.2", _metric, freeze=f"{prefix}.1", progress=False
        )

    _close(run(offloaded), run(plain))
