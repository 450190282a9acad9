"""Known answers for edge attribution, evaluate and exact edge effects, in float64 on tiny random HF models.

The reference is a forward written by hand in which every reader reads its own copy of the residual stream
(``x + zero`` with the zero a leaf, so that its gradient is the gradient through that reader alone and the graph
goes on upstream), on tiny random-weight HuggingFace Llama (grouped-query attention: 4 query heads, 2 key/value
groups) and GPT-2 models.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attribution.circuits import Circuit, edge_attribution, evaluate, exact_edge_effects, faithfulness, read_graph
from attribution.circuits._sites import reader_weights
from tests.attribution.models import tiny_llama

transformers = pytest.importorskip("transformers")

Reader = Callable[[str, torch.Tensor, dict], torch.Tensor]


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=24, n_layer=2, n_head=3)
    return transformers.GPT2LMHeadModel(config).eval().double()


class Float64RMSNorm(torch.nn.Module):
    """HF's LlamaRMSNorm without its cast to float32 (which would cap a float64 test at float32 precision)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def llama() -> torch.nn.Module:
    """The tiny GQA Llama in float64 throughout."""
    model = tiny_llama().double()
    for layer in model.model.layers:
        layer.input_layernorm = Float64RMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = Float64RMSNorm(layer.post_attention_layernorm)
    model.model.norm = Float64RMSNorm(model.model.norm)
    return model


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one head: (B, T, d) each."""
    t = q.shape[1]
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference(model: torch.nn.Module, ids: torch.Tensor, read: Reader, first: torch.Tensor | None = None):
    """Logits and writer activations of a forward by hand; ``read(reader, x, writers)`` is what each reader reads."""
    llama_style = hasattr(model, "model")
    t = ids.shape[1]
    if llama_style:
        base, blocks = model.model, model.model.layers
        x = base.embed_tokens(ids) if first is None else first
        cos, sin = base.rotary_emb(x, torch.arange(t)[None])
        heads, groups = model.config.num_attention_heads, model.config.num_key_value_heads
    else:
        base, blocks = model.transformer, model.transformer.h
        x = base.wte(ids) + base.wpe(torch.arange(t)) if first is None else first
        heads = groups = model.config.n_head
    d = x.shape[-1]
    dh = d // heads
    writers = {"embed": x}
    for layer, block in enumerate(blocks):
        if llama_style:
            norm1, norm2, attn = block.input_layernorm, block.post_attention_layernorm, block.self_attn
            wq, wk, wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight  # (out, in)
            bq = bk = bv = torch.zeros(heads * dh, dtype=x.dtype)
            wo, bo = attn.o_proj.weight, 0.0  # (d, heads * dh)
        else:
            norm1, norm2 = block.ln_1, block.ln_2
            w, b = block.attn.c_attn.weight.T, block.attn.c_attn.bias  # Conv1D: (in, out) -> (out, in)
            wq, wk, wv = w[:d], w[d : 2 * d], w[2 * d :]
            bq, bk, bv = b[:d], b[d : 2 * d], b[2 * d :]
            wo, bo = block.attn.c_proj.weight.T, block.attn.c_proj.bias

        def project(name: str, weight: torch.Tensor, bias: torch.Tensor, i: int) -> torch.Tensor:
            rows = slice(i * dh, (i + 1) * dh)
            return norm1(read(name, x, writers)) @ weight[rows].T + bias[rows]  # noqa: B023

        ks = [project(f"a{layer}.g{g}.k", wk, bk, g) for g in range(groups)]
        vs = [project(f"a{layer}.g{g}.v", wv, bv, g) for g in range(groups)]
        new = {}
        for h in range(heads):
            q = project(f"a{layer}.h{h}.q", wq, bq, h)
            g = h // (heads // groups)  # the key/value group of query head h
            k = ks[g]
            if llama_style:
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            z = _attend(q, k, vs[g], dh**-0.5)
            new[f"a{layer}.h{h}"] = z @ wo[:, h * dh : (h + 1) * dh].T
        writers.update(new)
        x = x + sum(new.values()) + bo
        writers[f"m{layer}"] = block.mlp(norm2(read(f"m{layer}", x, writers)))
        x = x + writers[f"m{layer}"]
    final = base.norm if llama_style else base.ln_f
    return model.lm_head(final(read("logits", x, writers))), writers


def upstream_of(reader: str, writers: list[str]) -> list[str]:
    """The writers feeding a reader, by the rule: a layer's heads feed its MLP, earlier layers feed everything."""
    if reader == "logits":
        return writers
    layer = int(reader.split(".")[0][1:])
    keep = ["embed"]
    for w in writers[1:]:
        w_layer = int(w.split(".")[0][1:])
        if w_layer < layer or (reader.startswith("m") and w.startswith("a") and w_layer == layer):
            keep.append(w)
    return keep


CLEAN = torch.tensor([[1, 7, 3, 9, 4], [5, 2, 8, 6, 11], [12, 3, 3, 14, 2]])
CORRUPTED = torch.tensor([[1, 7, 13, 9, 4], [5, 19, 8, 6, 11], [12, 3, 3, 14, 17]])


def metric(logits: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean() + 0.5 * logits[0, 2, 1] - 0.3 * logits[2, 1, 4]


def hand_scores(model: torch.nn.Module, ig_steps: int) -> tuple[list[str], list[str], torch.Tensor]:
    """EAP / EAP-IG by the definition: (a_w(corrupted) - a_w(clean)) . mean_i d metric / d (reader r's copy)."""
    with torch.no_grad():
        _, low = reference(model, CORRUPTED, lambda name, x, w: x)
        _, high = reference(model, CLEAN, lambda name, x, w: x)
    names = list(high)
    grads: dict[str, torch.Tensor] = {}
    for i in range(1, ig_steps + 1):
        first = low["embed"] + i / ig_steps * (high["embed"] - low["embed"])
        zeros: dict[str, torch.Tensor] = {}

        def read(name: str, x: torch.Tensor, writers: dict, zeros: dict = zeros) -> torch.Tensor:
            zeros[name] = torch.zeros_like(x, requires_grad=True)
            return x + zeros[name]

        logits, _ = reference(model, CLEAN, read, first)
        found = torch.autograd.grad(metric(logits), list(zeros.values()))
        for name, g in zip(zeros, found, strict=True):
            grads[name] = grads.get(name, 0) + g / ig_steps
    readers = list(grads)
    expected = torch.full((len(names), len(readers)), torch.nan, dtype=torch.float64)
    for j, r in enumerate(readers):
        for w in upstream_of(r, names):
            expected[names.index(w), j] = ((low[w] - high[w]) * grads[r]).sum()
    return names, readers, expected


@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_reference_forward_is_the_model(build):
    model = build()
    logits, _ = reference(model, CLEAN, lambda name, x, w: x)
    torch.testing.assert_close(logits, model(CLEAN).logits, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("ig_steps", [1, 3])
@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_every_score_is_the_gradient_decomposition(build, ig_steps):
    model = build()
    writers, readers, expected = hand_scores(model, ig_steps)
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=ig_steps, progress=False)
    assert scores.writers == writers
    assert sorted(scores.readers) == sorted(readers)
    got = scores.scores[:, [scores.readers.index(r) for r in readers]]
    assert torch.equal(got.isnan(), expected.isnan())
    scale = float(expected.nan_to_num().abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10 * scale, equal_nan=True)
    assert scores.ig_steps == ig_steps
    with torch.no_grad():
        assert scores.clean_metric == pytest.approx(float(metric(model(CLEAN))), abs=1e-12)
        assert scores.corrupted_metric == pytest.approx(float(metric(model(CORRUPTED))), abs=1e-12)


def one_layer_gpt2() -> torch.nn.Module:
    """GPT-2 of one layer of two 4-dimensional heads: the EAP-IG known answer of the edit loop."""
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval().double()


def test_eap_ig_scores_are_the_gradients_at_its_points_fast():
    """EAP-IG with 2 points (1/2 and 1 of the way from corrupted to clean), against the definition, in well under 1 s.

    The slow test above covers two models and 3 points; this one fails as well when the points shift by a step.
    """
    model = one_layer_gpt2()
    writers, readers, expected = hand_scores(model, 2)
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=2, progress=False)
    assert scores.writers == writers and sorted(scores.readers) == sorted(readers)
    got = scores.scores[:, [scores.readers.index(r) for r in readers]]
    assert torch.equal(got.isnan(), expected.isnan())
    scale = float(expected.nan_to_num().abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10 * scale, equal_nan=True)
    eap = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False).scores  # the point at 1 alone
    assert float((eap - got).nan_to_num().abs().max()) > 0.01 * scale  # the point at 1/2 is seen


def test_readers_come_in_graph_order_with_one_k_and_v_per_group():
    scores = edge_attribution(llama(), CLEAN, CORRUPTED, metric, progress=False)
    layer0 = [f"a0.h{h}.q" for h in range(4)] + ["a0.g0.k", "a0.g1.k", "a0.g0.v", "a0.g1.v", "m0"]
    assert scores.readers[:9] == layer0
    assert scores.readers[-1] == "logits"
    assert scores.writers[:6] == ["embed", "a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0"]
    assert int(scores.scores.isfinite().sum()) == 1 * 8 + 5 * 1 + 6 * 8 + 10 * 1 + 11  # 82 edges


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_full_and_empty_circuits_are_exactly_clean_and_corrupted(build):
    model = build()
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    full = scores.top(10_000)
    with torch.no_grad():
        clean, corrupted = float(metric(model(CLEAN))), float(metric(model(CORRUPTED)))
    assert evaluate(model, CLEAN, CORRUPTED, metric, full) == clean
    assert evaluate(model, CLEAN, CORRUPTED, metric, Circuit(edges=[])) == corrupted
    assert faithfulness(model, CLEAN, CORRUPTED, metric, [Circuit(), full]).tolist() == [0.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_a_random_half_circuit_is_the_per_reader_forward(build):
    model = build()
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    edges = [(w, r) for w, r, _ in scores.edges()]
    order = torch.randperm(len(edges), generator=torch.Generator().manual_seed(0)).tolist()
    circuit = Circuit(edges=[edges[i] for i in order[: len(edges) // 2]])
    with torch.no_grad():
        _, low = reference(model, CORRUPTED, lambda name, x, w: x)

        def read(reader: str, x: torch.Tensor, writers: dict) -> torch.Tensor:
            out = [w for w in upstream_of(reader, list(low)) if (w, reader) not in circuit]
            return x - sum((writers[w] - low[w] for w in out), torch.zeros_like(x))

        expected = float(metric(reference(model, CLEAN, read)[0]))
    got = evaluate(model, CLEAN, CORRUPTED, metric, circuit)
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert abs(expected - scores.clean_metric) > 1e-3  # the half circuit changes the metric: the test has teeth


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_exact_edge_effects_are_the_one_edge_forward(build):
    model = build()
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    chosen = [(w, r) for w, r, _ in scores.edges(4)] + [("embed", "logits"), ("a1.h0", "logits")]
    exact = exact_edge_effects(model, CLEAN, CORRUPTED, metric, chosen, progress=False)
    with torch.no_grad():
        _, low = reference(model, CORRUPTED, lambda name, x, w: x)
        clean = float(metric(model(CLEAN)))
        for (writer, reader), value in zip(chosen, exact.tolist(), strict=True):

            def read(name: str, x: torch.Tensor, writers: dict) -> torch.Tensor:
                return x - (writers[writer] - low[writer]) if name == reader else x  # noqa: B023

            expected = float(metric(reference(model, CLEAN, read)[0])) - clean
            assert value == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.slow
def test_exact_edge_effects_converge_to_the_eap_score():
    """As corrupted -> clean, exact / EAP -> 1 for fixed edges, with a relative error shrinking like the distance."""
    model = llama()
    embeds = model.model.embed_tokens(CLEAN).detach()
    noise = torch.randn(embeds.shape, generator=torch.Generator().manual_seed(0), dtype=embeds.dtype)
    edges, errors = None, []
    for t in (1e-3, 1e-4):
        clean, corrupted = {"inputs_embeds": embeds}, {"inputs_embeds": embeds + t * noise}
        scores = edge_attribution(model, clean, corrupted, metric, progress=False)
        edges = edges or [(w, r) for w, r, _ in scores.edges(6)]
        eap = torch.stack([scores.scores[scores.writers.index(w), scores.readers.index(r)] for w, r in edges])
        exact = exact_edge_effects(model, clean, corrupted, metric, edges, progress=False)
        errors.append(((exact - eap).abs() / eap.abs()).max().item())
    assert errors[1] < 0.15 * errors[0]
    assert errors[1] < 5e-3


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_edges_batched_in_one_forward_equal_one_edge_per_forward(build):
    """7 edges in forwards of 3 (3 + 3 + 1, readers of every kind, unsorted) give the one-edge-per-forward values."""
    model = build()
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    extra = [("embed", "logits"), ("a1.h0", "logits"), ("a0.h2", "m0"), ("a0.h1", "a1.h2.q"), ("m0", "a1.g1.v")]
    chosen = list(dict.fromkeys([(w, r) for w, r, _ in scores.edges(4)] + extra))[:7]
    chosen = chosen[::-1]  # the readers out of order: the forwards sort them, the result keeps this order
    one = exact_edge_effects(model, CLEAN, CORRUPTED, metric, chosen, edges_per_run=1, progress=False)
    three = exact_edge_effects(model, CLEAN, CORRUPTED, metric, chosen, edges_per_run=3, progress=False)
    all_in_one = exact_edge_effects(model, CLEAN, CORRUPTED, metric, chosen, edges_per_run=100, progress=False)
    scale = float(one.abs().max())
    torch.testing.assert_close(three, one, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(all_in_one, one, rtol=0, atol=1e-12 * scale)
    assert len(set(one.tolist())) == len(chosen)  # distinct values: a copy read another copy's patch would show


def test_edges_per_run_must_be_a_positive_int():
    with pytest.raises(ValueError, match="`edges_per_run`"):
        exact_edge_effects(tiny_gpt2(), CLEAN, CORRUPTED, metric, [("embed", "logits")], edges_per_run=0)


def test_gqa_reader_weights_are_the_q_k_v_slices_in_graph_order():
    """The attention readers' weight slices: query heads, then one key and one value slice per group (fast)."""
    model = tiny_llama()
    graph = read_graph(model)
    weight, bias = reader_weights(model, graph, 1)
    attention = model.model.layers[1].self_attn
    d = graph.d_head
    expected = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).unflatten(
        0, (-1, d)
    )
    assert weight.shape == (graph.n_heads + 2 * graph.n_groups, d, 32) and torch.equal(weight, expected)
    assert torch.equal(bias, torch.zeros(len(weight), d))
