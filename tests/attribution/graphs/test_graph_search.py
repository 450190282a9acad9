"""The cost and the search: autograd runs, nodes visited by influence, rows cut to their largest entries, refusals."""

from __future__ import annotations

import math

import pytest
import torch

import attribution.graphs.build as build
from attribution.graphs import attribution_graph
from attribution.graphs._math import kept_entries, merged_entries, top_entries
from tests.attribution.graphs.conftest import IDS
from tests.support import hook_state


def _count_engine_runs(monkeypatch) -> list[int]:
    """Count the runs of the autograd engine (every autograd.grad and backward goes through this function)."""
    runs = [0]
    original = torch.autograd._engine_run_backward

    def counted(*args, **kwargs):
        runs[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "_engine_run_backward", counted)
    return runs


@pytest.mark.parametrize(("max_nodes", "batch_size"), [(None, 50), (40, 7)])
def test_autograd_runs_are_ceil_targets_over_batch_plus_at_most_two(llama, monkeypatch, max_nodes, batch_size):
    runs = _count_engine_runs(monkeypatch)
    graph = attribution_graph(llama, IDS, max_nodes=max_nodes, batch_size=batch_size, progress=False)
    targets = len(graph.nodes.where("neuron")) + len(graph.nodes.where("logit"))
    assert len(graph.nodes.where("neuron")) == (max_nodes or 288)
    assert runs[0] == graph.runs
    slopes = 1  # one pass reads every neuron's slopes by its pre-activations (its rows go in at the MLP's input)
    assert runs[0] == math.ceil(10 / batch_size) + math.ceil((max_nodes or 288) / batch_size) + slopes
    assert runs[0] <= math.ceil(targets / batch_size) + 2


def _dense_partial_influence(full, rows, weights, n):
    """circuit-tracer's compute_partial_influences, dense: full rows (rows x sources) normalised by |row| sums."""
    matrix = full.abs() / full.abs().sum(1, keepdim=True).clamp_min(1e-8)
    influence = torch.zeros(n, dtype=torch.float64)
    prod = weights.clone()  # one entry per row: the logit weights first
    for _ in range(100):
        step = prod @ matrix
        if not step.any():
            return influence
        influence += step
        prod = torch.tensor([step[r] if r >= 0 else 0.0 for r in rows], dtype=torch.float64)
    raise AssertionError("no convergence")


def test_neurons_are_visited_most_influential_first(llama, llama_graph):
    """With max_nodes, batch 1 is the top by influence through the logit rows, batch 2 the top through all rows."""
    batch = 16
    graph = attribution_graph(llama, IDS, max_nodes=2 * batch, batch_size=batch, progress=False)
    full = llama_graph.adjacency.to_dense().double()  # every node: the rows the search saw, uncut
    neurons, tokens = llama_graph.nodes.where("neuron"), llama_graph.nodes.where("token")
    logits = llama_graph.nodes.where("logit")
    sources = torch.cat([neurons, tokens])
    weights = llama_graph.logit_weights.double()
    first = _dense_partial_influence(full[logits][:, sources], [-1] * len(logits), weights, len(sources))
    chosen_1 = first[: len(neurons)].topk(batch).indices
    rows = torch.cat([logits, chosen_1])
    starts = torch.cat([weights, torch.zeros(batch, dtype=torch.float64)])
    second = _dense_partial_influence(full[rows][:, sources], [-1] * len(logits) + chosen_1.tolist(), starts,
                                      len(sources))  # fmt: skip
    second[chosen_1] = -1
    chosen_2 = second[: len(neurons)].topk(batch).indices
    expected = {tuple(llama_graph.nodes[int(i)].__dict__[k] for k in ("layer", "position", "index"))
                for i in torch.cat([chosen_1, chosen_2])}  # fmt: skip
    got = {(g.layer, g.position, g.index) for g in (graph.nodes[int(i)] for i in graph.nodes.where("neuron"))}
    assert got == expected
    assert len(got) == 2 * batch


def test_a_search_keeps_each_visited_neurons_own_row(llama, llama_graph):
    """Rows of a batch chosen by influence (its layers mixed) land on their own nodes: the full graph's rows."""
    graph = attribution_graph(llama, IDS, max_nodes=40, batch_size=16, progress=False)
    full = {(n.kind, n.layer, n.position, n.index): i for i, n in enumerate(llama_graph.nodes)}
    mine = torch.tensor([full[(n.kind, n.layer, n.position, n.index)] for n in graph.nodes])
    layers = graph.nodes.layer[graph.nodes.where("neuron")]
    assert len(torch.unique(layers)) == 2  # batches chosen by influence, both layers in them
    expected = llama_graph.adjacency.to_dense()[mine][:, mine]
    got = graph.adjacency.to_dense()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_rows_keep_their_largest_entries(llama, llama_graph):
    keep = 20
    cut = attribution_graph(llama, IDS, edges_per_row=keep, batch_size=128, progress=False)
    full, got = llama_graph.adjacency.to_dense(), cut.adjacency.to_dense()
    targets = torch.cat([llama_graph.nodes.where("neuron"), llama_graph.nodes.where("logit")])
    for t in targets.tolist():
        row = full[t]
        kept = row.abs().topk(keep).indices
        expected = torch.zeros_like(row)
        expected[kept] = row[kept]
        assert torch.equal(got[t], expected), t
    assert cut.adjacency._nnz() <= keep * len(targets)


def test_kept_entries_of_blocks_are_the_dense_rows_largest():
    """Blocks of both signs, columns left out between them, a row with fewer non-zeros than kept: the dense top-k."""
    torch.manual_seed(0)
    widths, gaps, keep = [3, 40, 9, 60, 1, 25], [0, 2, 0, 5, 1, 0], 7
    dense, blocks, start = torch.zeros(5, sum(widths) + sum(gaps), dtype=torch.float64), [], 0
    for width, gap in zip(widths, gaps, strict=True):
        start += gap
        block = torch.randn(5, width, dtype=torch.float64) * torch.rand(5, 1, dtype=torch.float64) * 10
        block[3] = 0
        blocks.append((start, block))
        dense[:, start : start + width] = block
        start += width
    dense[3, [1, 50, 51, 110]] = torch.tensor([2.0, -3.0, 0.5, -1.0], dtype=torch.float64)
    for begin, block in blocks:
        block[3] = dense[3, begin : begin + block.shape[1]]
    columns, values, sums = kept_entries(blocks, keep)
    assert columns.shape == values.shape == (5, keep)
    torch.testing.assert_close(sums, dense.abs().sum(1), rtol=1e-14, atol=0)
    for row in range(5):
        expected = dense[row].abs().topk(keep).indices
        expected = expected[dense[row, expected] != 0]
        got = columns[row][values[row] != 0]
        assert got.tolist() == expected.tolist(), row  # the same columns, largest first
        assert torch.equal(values[row][values[row] != 0], dense[row, expected])
    assert columns[3, :4].tolist() == [50, 1, 110, 51]


def test_entries_cut_block_by_block_under_vmap_are_the_dense_rows_largest():
    """Tokens, a layer's units and its error interleaved per position (width units + 1), cut per block by each row
    (under vmap, as in the backward's hooks), then merged: each dense row's top-k and its sum of magnitudes."""
    torch.manual_seed(1)
    rows, positions, units, keep = 4, 6, 5, 9
    tokens = torch.randn(rows, positions, 1, dtype=torch.float64)
    leaf = torch.randn(rows, positions, units, dtype=torch.float64) * torch.rand(rows, 1, 1, dtype=torch.float64) * 10
    error = torch.randn(rows, positions, 1, dtype=torch.float64) * 3
    leaf[2], error[2] = 0, 0  # a row with fewer non-zeros than kept
    start = positions
    dense = torch.cat([tokens.flatten(1), torch.cat([leaf, error], -1).flatten(1)], 1)  # the source columns
    layout = ((tokens, 0, 1), (leaf, start, units + 1), (error, start + units, units + 1))
    blocks = [torch.func.vmap(lambda b, s=s, w=w: top_entries(b, s, w, keep))(block) for block, s, w in layout]
    columns, values, sums = merged_entries(blocks, keep)
    assert columns.shape == values.shape == (rows, keep)
    torch.testing.assert_close(sums, dense.abs().sum(1), rtol=1e-14, atol=0)
    for row in range(rows):
        expected = dense[row].abs().topk(keep).indices
        expected = expected[dense[row, expected] != 0]
        got = columns[row][values[row] != 0]
        assert got.tolist() == expected.tolist(), row  # the same columns, largest first
        assert torch.equal(values[row][values[row] != 0], dense[row, expected])


def test_a_graph_too_big_for_free_memory_is_refused_before_any_work(llama, monkeypatch):
    monkeypatch.setattr(build, "free_memory", lambda device=None: 10_000)
    calls = []
    handle = llama.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"needs about .* GiB .*lower `max_nodes` \(now None\), `batch_size`"):
            attribution_graph(llama, IDS, progress=False)
    finally:
        handle.remove()
    assert not calls


def test_the_model_is_left_as_found_also_after_an_error(llama):
    llama.train()
    llama.lm_head.weight.grad = torch.ones_like(llama.lm_head.weight)
    before = hook_state(llama)
    try:
        with torch.no_grad():
            attribution_graph(llama, IDS, max_nodes=8, batch_size=4, progress=False)
            assert not torch.is_grad_enabled()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            attribution_graph(llama, IDS, target=[999], progress=False)  # raised after the forward, inside the run
        assert hook_state(llama) == before
        assert llama.training and all(m.training for m in llama.modules())
        assert all(p.requires_grad for p in llama.parameters())
        assert torch.equal(llama.lm_head.weight.grad, torch.ones_like(llama.lm_head.weight))
        assert all(p.grad is None for n, p in llama.named_parameters() if n != "lm_head.weight")
    finally:
        llama.lm_head.weight.grad = None
        llama.eval()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"basis": "features"}, ValueError, "`basis` must be 'neurons'"),
        ({"basis": {"model.layers.0.mlp": object()}}, TypeError, "must be an SAE or a Transcoder"),
        ({"rules": "lrp"}, ValueError, "`rules` must be None"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be a positive int"),
        ({"max_nodes": -1}, ValueError, "`max_nodes` must be None or an int"),
        ({"target": "cat"}, TypeError, "`target` must be None, a token id"),
    ],
)
def test_bad_arguments_say_what_was_expected(llama, kwargs, error, match):
    with pytest.raises(error, match=match):
        attribution_graph(llama, IDS, progress=False, **kwargs)


def test_two_prompts_are_refused(llama):
    with pytest.raises(ValueError, match="must be one prompt"):
        attribution_graph(llama, torch.stack([IDS, IDS]), progress=False)


def test_a_mixture_of_experts_and_a_parallel_residual_are_refused():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=20, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2)).eval()  # fmt: skip
    with pytest.raises(ValueError, match=r"no dense MLP in 'model.layers.0.mlp' \(looked for gate_proj/up_proj"):
        attribution_graph(moe, torch.tensor([1, 2]), progress=False)
    config = transformers.GPTNeoXConfig(vocab_size=20, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2)  # fmt: skip
    neox = transformers.GPTNeoXForCausalLM(config).eval()
    with pytest.raises(ValueError, match="has a parallel residual"):
        attribution_graph(neox, torch.tensor([1, 2]), progress=False)


def test_keyword_inputs_give_the_same_graph(llama, llama_graph):
    graph = attribution_graph(llama, {"input_ids": IDS[None], "use_cache": False}, batch_size=128, progress=False)
    assert torch.equal(graph.adjacency.to_dense(), llama_graph.adjacency.to_dense())
