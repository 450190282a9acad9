"""feature_statistics on real HuggingFace models: neurons and features against hand-written hooks, logit effects,
the model left as found, and bad input answered by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from attribution import SAE, Transcoder
from attribution.features import Directions, Features, Heads, Neurons, feature_statistics
from tests.attribution.models import lm64, tiny_llama

from .conftest import brute_top


def _by_hand(model, module_name: str, ids: torch.Tensor, side: str) -> torch.Tensor:
    """The module's input (or output) over all documents, read with a plain PyTorch hook: ``(docs, tokens, width)``."""
    seen = []
    module = model.get_submodule(module_name)
    if side == "input":
        handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().float()))
    else:
        handle = module.register_forward_hook(lambda m, args, out: seen.append(out.detach().float()))
    try:
        with torch.no_grad():
            for start in range(0, len(ids), 4):
                model(ids[start : start + 4])
    finally:
        handle.remove()
    return torch.cat(seen)


@pytest.mark.parametrize(("kind", "site"), [("llama", "model.layers.1.mlp.down_proj"),
                                            ("gpt2", "transformer.h.1.mlp.c_proj")])  # fmt: skip
def test_neurons_top_examples_equal_those_found_with_hand_written_hooks(kind, site):
    model = lm64(kind)
    ids = torch.randint(1, 40, (9, 10), generator=torch.Generator().manual_seed(3))
    report = feature_statistics(model, ids, Neurons(1, indices=[5, 0, 17]), k=4, bands=0, context=(1, 1),
                                batch_size=4, progress=False)  # fmt: skip
    acts = _by_hand(model, site, ids, "input")[..., [5, 0, 17]]
    special = torch.tensor([i for i in (model.config.bos_token_id, model.config.eos_token_id) if i is not None])
    included = ~torch.isin(ids, special)
    expected = brute_top(acts, included, 4, 3)
    for u in range(3):
        assert [(e.value, e.document, e.position) for e in report.top(u)] == expected[u]
    assert report.labels == ["L1/N5", "L1/N0", "L1/N17"]
    assert report.find("neuron", 1, 17) == 2 and report.find("neuron", 0, 17) is None


@pytest.mark.parametrize(("kind", "site"), [("llama", "model.layers.1.self_attn.o_proj"),
                                            ("gpt2", "transformer.h.1.attn.c_proj")])  # fmt: skip
def test_heads_read_the_norm_of_what_each_head_writes_by_hand(kind, site):
    """A head's activation: the norm of its slice of the output projection's input times its columns, by hand."""
    model = lm64(kind)
    ids = torch.randint(1, 40, (9, 10), generator=torch.Generator().manual_seed(5))
    report = feature_statistics(model, ids, Heads(1, indices=[3, 0]), k=4, bands=2, context=(1, 1),
                                batch_size=4, progress=False)  # fmt: skip
    z = _by_hand(model, site, ids, "input")  # (docs, tokens, heads * head_dim)
    module = model.get_submodule(site)
    w = (module.weight.detach().T if kind == "gpt2" else module.weight.detach()).float()  # (d_model, h * size)
    heads = model.config.num_attention_heads
    size = z.shape[-1] // heads
    acts = torch.stack([(z[..., h * size : (h + 1) * size] @ w[:, h * size : (h + 1) * size].T).norm(dim=-1)
                        for h in (3, 0)], dim=-1)  # fmt: skip
    special = torch.tensor([i for i in (model.config.bos_token_id, model.config.eos_token_id) if i is not None])
    included = ~torch.isin(ids, special)
    expected = brute_top(acts, included, 4, 3)
    for u in range(2):
        got = [(e.value, e.document, e.position) for e in report.top(u)]
        assert [(d, p) for _, d, p in got] == [(d, p) for _, d, p in expected[u]]
        assert [v for v, _, _ in got] == pytest.approx([v for v, _, _ in expected[u]], rel=1e-5)
    assert report.labels == ["L1/H3", "L1/H0"]
    assert report.find("head", 1, 0) == 1
    with pytest.raises(ValueError, match="no logit effects"):
        report.logit_effects(0)
    with pytest.raises(ValueError, match="in \\[0, 4\\)"):
        Heads(1, indices=[4]).bind(model)


def test_a_dictionary_with_a_duplicated_feature_finds_its_twin_with_correlation_one():
    model = tiny_llama()
    torch.manual_seed(4)
    sae = SAE(32, 16, activation="relu")
    with torch.no_grad():
        sae.W_enc[:, 9] = sae.W_enc[:, 2]
        sae.b_enc[9] = sae.b_enc[2]
    ids = torch.randint(2, 50, (8, 12), generator=torch.Generator().manual_seed(0))
    report = feature_statistics(model, ids, Features(sae, "model.layers.0"), k=3, bands=2,
                                context=(1, 1), progress=False)  # fmt: skip
    twin, r = report.neighbours(2, 3)[0]
    assert twin == 9 and r == pytest.approx(1.0, abs=1e-12)
    acts = _by_hand(model, "model.layers.0", ids, "output")
    features = sae.encode(acts).detach()
    assert report.top(2)[0].value == float(features[..., 2].max())
    assert report.labels[2] == "L0/F2"


def test_a_transcoder_reads_its_modules_input():
    model = tiny_llama()
    torch.manual_seed(5)
    transcoder = Transcoder(32, 32, 8)
    ids = torch.randint(2, 50, (5, 8), generator=torch.Generator().manual_seed(1))
    report = feature_statistics(model, ids, Features(transcoder, "model.layers.1.mlp"), k=2, bands=0,
                                context=(1, 1), progress=False)  # fmt: skip
    features = transcoder.encode(_by_hand(model, "model.layers.1.mlp", ids, "input")).detach()
    assert report.max.tolist() == features.amax((0, 1)).tolist()


def test_logit_effects_on_a_model_with_a_known_unembedding():
    """With an RMSNorm gain g and unembedding W_U, direction e_j raises token t's logit by W_U[t, j] g[j]."""
    model = tiny_llama(vocab_size=6, hidden_size=4, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    W_U = torch.tensor([[1.0, 0, 0, 0], [-2, 1, 0, 0], [3, 0, 0, -1], [0.5, 2, 0, 0], [0, -3, 1, 0], [0, 0, 0, 4]])
    with torch.no_grad():
        model.lm_head.weight.copy_(W_U)
        model.model.norm.weight.copy_(torch.tensor([2.0, 0.5, 1.0, -1.0]))
    vectors = torch.eye(4)
    report = feature_statistics(model, torch.randint(1, 6, (3, 5)), Directions(vectors, "model.layers.1"), k=1,
                                bands=0, context=(1, 1), progress=False)  # fmt: skip
    top, bottom = report.logit_effects(0, 3)
    assert top == [(2, 6.0), (0, 2.0), (3, 1.0)] and bottom[0] == (1, -4.0)
    top, bottom = report.logit_effects(3, 2)
    assert top[0] == (2, 1.0) and bottom[0] == (5, -4.0)
    with pytest.raises(ValueError, match="at most 6"):
        report.logit_effects(0, 7)


def test_logit_effects_centre_the_direction_for_a_layernorm():
    model = lm64("gpt2")
    report = feature_statistics(model, torch.randint(1, 40, (2, 4)), Neurons(0, indices=[3]), k=1, bands=0,
                                context=(1, 1), progress=False)  # fmt: skip
    w = model.transformer.h[0].mlp.c_proj.weight[3].detach().double()  # Conv1D: row i is neuron i's output
    g = model.transformer.ln_f.weight.detach().double()
    expected = model.lm_head.weight.detach().double() @ (g * (w - w.mean()))
    top, bottom = report.logit_effects(0, 3)
    assert [t for t, _ in top] == expected.topk(3).indices.tolist()
    assert [v for _, v in top] == pytest.approx(expected.topk(3).values.tolist(), rel=1e-6)
    assert [t for t, _ in bottom] == expected.topk(3, largest=False).indices.tolist()


def test_the_model_is_left_as_found_and_its_outputs_unchanged():
    model = tiny_llama().train()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    ids = torch.randint(2, 50, (4, 6), generator=torch.Generator().manual_seed(2))
    model.eval()
    before = model(ids).logits
    model.train()
    flags = [m.training for m in model.modules()]
    grads = [p.requires_grad for p in model.parameters()]
    feature_statistics(model, ids, [Neurons(0), Directions(torch.randn(2, 32), "model.layers.1")], k=2,
                       context=(1, 1), progress=False)  # fmt: skip
    assert [m.training for m in model.modules()] == flags and all(flags)
    assert [p.requires_grad for p in model.parameters()] == grads
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.is_grad_enabled()
    model.eval()
    assert torch.equal(model(ids).logits, before)


def test_units_of_several_kinds_are_numbered_in_turn():
    model = tiny_llama()
    ids = torch.randint(2, 50, (3, 6))
    report = feature_statistics(model, ids, [Neurons(1, indices=[2]), Directions(torch.randn(3, 32), "model.layers.0",
                                names=["a", "b", "c"])], k=1, bands=0, context=(1, 1), progress=False)  # fmt: skip
    assert report.labels == ["L1/N2", "a", "b", "c"]
    assert report.index("b") == 2 and report.find("direction", 0, 1) == 2


def test_bad_input_is_answered_by_name(planted):
    model, ids, _table = planted
    with pytest.raises(ValueError, match="width 6"):
        feature_statistics(model, ids, Directions(torch.eye(5), "embed"), progress=False)
    with pytest.raises(KeyError, match="embed"):
        feature_statistics(model, ids, Directions(torch.eye(6), "embedd"), progress=False)
    with pytest.raises(ValueError, match="empty"):
        feature_statistics(model, ids[:0], Directions(torch.eye(6), "embed"), progress=False)
    with pytest.raises(ValueError, match="gave no batches"):
        feature_statistics(model, [], Directions(torch.eye(6), "embed"), progress=False)
    with pytest.raises(TypeError, match="token ids"):
        feature_statistics(model, ids.float(), Directions(torch.eye(6), "embed"), progress=False)
    with pytest.raises(TypeError, match="Neurons"):
        feature_statistics(model, ids, "embed", progress=False)
    with pytest.raises(ValueError, match="`k`"):
        feature_statistics(model, ids, Directions(torch.eye(6), "embed"), k=0, progress=False)
    with pytest.raises(ValueError, match="layers"):
        feature_statistics(tiny_llama(), ids, Neurons(2), progress=False)
    with pytest.raises(IndexError, match=r"\[0, 6\)"):
        feature_statistics(model, ids, Directions(torch.eye(6), "embed"), bands=0, progress=False).top(6)


def test_nan_activations_are_reported_with_document_and_position_and_left_out(planted):
    model, ids, _table = planted
    bad = int(ids[4, 7])
    model.embed.weight.data[bad, 1] = float("nan")
    with pytest.warns(UserWarning, match=f"document {int((ids == bad).nonzero()[0, 0])} position"):
        report = feature_statistics(model, ids, Directions(torch.eye(6), "embed"), k=3, bands=0, progress=False)
    # a direction's value is a dot product with the whole vector: NaN for every direction where the token is
    assert report.nans.tolist() == [int((ids == bad).sum())] * 6
    assert report.count.tolist() == [ids.numel() - int((ids == bad).sum())] * 6
    assert not torch.isnan(report.mean).any() and all(e.value == e.value for e in report.top(1))


def test_documents_shorter_than_the_context_give_cut_contexts_and_a_warning(planted):
    model, ids, _ = planted
    with pytest.warns(UserWarning, match="shorter than the context"):
        report = feature_statistics(model, ids[:, :3], Directions(torch.eye(6), "embed"), k=2, bands=0,
                                    progress=False)  # fmt: skip
    assert all(len(e.tokens) == 3 for e in report.top(0))


def test_a_clean_run_is_silent(planted):
    model, ids, _ = planted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feature_statistics(model, ids, Directions(torch.eye(6), "embed"), k=2, bands=2, progress=False)
