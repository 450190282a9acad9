"""Circuit, EdgeScores, the graph, bad input and the model left as it was found."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from attribution.circuits import (
    Circuit,
    EdgeScores,
    edge_attribution,
    evaluate,
    exact_edge_effects,
    faithfulness,
    faithfulness_curve,
    read_graph,
)
from attribution.circuits.plot import circuit_layout, node_key
from tests.attribution.models import tiny_llama
from tests.support import hook_state

transformers = pytest.importorskip("transformers")

CLEAN = torch.tensor([[1, 7, 3, 9], [5, 2, 8, 6]])
CORRUPTED = torch.tensor([[1, 7, 13, 9], [5, 19, 8, 6]])


def metric(out) -> torch.Tensor:
    return (out.logits[:, -1, 3] - out.logits[:, -1, 7]).mean()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# -- Circuit ------------------------------------------------------------------------------------------------------
def test_circuit_is_an_ordered_set_of_edges(tmp_path):
    a = Circuit(edges=[("embed", "a0.h1.q"), ("a0.h1", "logits"), ("embed", "a0.h1.q")])
    b = Circuit(edges=[("a0.h1", "logits"), ("m0", "logits")])
    assert len(a) == 2 and list(a) == [("embed", "a0.h1.q"), ("a0.h1", "logits")]
    assert ("a0.h1", "logits") in a and ("m0", "logits") not in a
    assert list(a | b) == [("embed", "a0.h1.q"), ("a0.h1", "logits"), ("m0", "logits")]
    assert list(a & b) == [("a0.h1", "logits")] and list(b & a) == [("a0.h1", "logits")]
    assert a.union(b) == b.union(a) and a.intersection(b) == a & b
    assert len(Circuit(edges=[])) == 0 == len(Circuit())
    assert a.nodes == ["embed", "a0.h1.q", "a0.h1", "logits"]
    a.save(tmp_path / "c.json")
    assert Circuit.load(tmp_path / "c.json") == a
    assert list(Circuit.load(tmp_path / "c.json")) == list(a)
    assert json.loads((tmp_path / "c.json").read_text()) == {"edges": [["embed", "a0.h1.q"], ["a0.h1", "logits"]]}


def test_circuit_rejects_what_is_not_an_edge():
    with pytest.raises(TypeError, match=r"`edges` must hold \(writer, reader\) pairs"):
        Circuit(edges=[("embed", "a0.h1.q", "x")])
    with pytest.raises(ValueError, match="must be"):
        Circuit.from_json("[1, 2]")


# -- EdgeScores ---------------------------------------------------------------------------------------------------
def test_top_ranks_by_absolute_score_of_either_sign():
    scores = torch.tensor([[0.1, -3.0, 2.0], [torch.nan, 0.5, -2.5]])
    edges = EdgeScores(["embed", "a0.h0"], ["a0.h0.q", "m0", "logits"], scores, 1.0, 0.0)
    assert edges.edges(3) == [("embed", "m0", -3.0), ("a0.h0", "logits", -2.5), ("embed", "logits", 2.0)]
    assert list(edges.top(2)) == [("embed", "m0"), ("a0.h0", "logits")]
    assert len(edges.top(100)) == 5  # the NaN is not an edge
    assert len(edges.top(0)) == 0
    frame = edges.to_dataframe()
    assert list(frame.columns) == ["writer", "reader", "score"] and len(frame) == 5
    assert frame.iloc[0].tolist() == ["embed", "m0", -3.0]


def test_plot_draws_the_circuit(model, tmp_path):
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    ax = scores.plot(15)
    ax.figure.savefig(tmp_path / "circuit.png")
    assert (tmp_path / "circuit.png").stat().st_size > 5_000
    assert len(ax.patches) == 15
    labels = {t.get_text() for t in ax.texts}
    assert labels == {n for w, r, _ in scores.edges(15) for n in (w, r)}  # every node of the circuit, once
    widths = [p.get_linewidth() for p in ax.patches]
    assert max(widths) == pytest.approx(4.9) and min(widths) < max(widths)  # width by |score|
    colours = {p.get_edgecolor()[:3] for p in ax.patches}
    signs = {s < 0 for *_, s in scores.edges(15)}
    assert len(colours) == len(signs)  # one colour per sign present


def test_layout_orders_each_row_by_head_with_k_v_and_q_before_their_heads():
    # 4 heads, 2 groups: group 1 holds heads 2 and 3
    names = ["a0.h3", "a0.g1.v", "m0", "a0.h2.q", "a0.g1.k", "a0.h2", "embed", "a2.h0", "logits"]
    layout = circuit_layout(names, heads=4, groups=2)
    row = sorted((x, name) for name, (x, y) in layout.items() if y == 1.0)
    assert [name for _, name in row] == ["a0.g1.k", "a0.g1.v", "a0.h2.q", "a0.h2", "a0.h3", "m0"]
    xs = [x for x, _ in row]
    assert min(b - a for a, b in itertools.pairwise(xs)) >= 0.08 - 1e-6  # labels apart
    assert 0 <= xs[0] and xs[-1] <= 1
    assert layout["a2.h0"] == (0.2, 2.0)  # layer 1 has no node: its row is left out; head 0 of 4 at 1/5
    crowded = circuit_layout([f"a0.h{h}" for h in range(30)], heads=30, groups=30)
    even = [i / 29 for i in range(30)]
    assert sorted(x for x, _ in crowded.values()) == pytest.approx(even, abs=1e-6)  # too full: evenly spread
    assert layout["logits"] == (0.5, 3.0) and layout["embed"] == (0.5, 0.0)
    assert node_key("a1.h3", 4, 2) == (2, 3.0)
    with pytest.raises(ValueError, match="not a node name"):
        node_key("b1", 4, 2)


# -- the graph ----------------------------------------------------------------------------------------------------
def test_graph_of_gqa_llama(model):
    graph = read_graph(model)
    assert (graph.n_heads, graph.n_groups, graph.d_head) == (4, 2, 8)
    assert graph.layers[1].q == "model.layers.1.self_attn.q_proj" and graph.final_norm == "model.norm"
    assert graph.upstream().tolist() == [1] * 8 + [5] + [6] * 8 + [10] + [11]
    assert graph.n_edges == int(graph.edge_mask().sum()) == 82


def test_unknown_architecture_names_what_is_missing():
    with pytest.raises(ValueError, match="could not find the decoder layers"):
        read_graph(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_output_projection_without_per_head_layout(model):
    with pytest.raises(ValueError, match="no per-head layout"):
        read_graph(model, n_heads=3, n_kv_heads=1)


def test_gemma2_sandwich_norms_are_refused():
    config = transformers.Gemma2Config(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match="Gemma 2/3"):
        read_graph(transformers.Gemma2ForCausalLM(config))


# -- bad input ----------------------------------------------------------------------------------------------------
def test_inputs_of_different_shapes(model):
    with pytest.raises(ValueError, match="same shapes"):
        edge_attribution(model, CLEAN, CORRUPTED[:, :3], metric, progress=False)
    with pytest.raises(ValueError, match="same shapes"):
        evaluate(model, CLEAN, CORRUPTED[:1], metric, Circuit())


def test_metric_that_does_not_depend_on_the_output(model):
    with pytest.raises(ValueError, match="does not depend on the model's output"):
        edge_attribution(model, CLEAN, CORRUPTED, lambda out: torch.tensor(1.0), progress=False)
    with pytest.raises(ValueError, match="a scalar tensor"):
        edge_attribution(model, CLEAN, CORRUPTED, lambda out: out.logits[:, -1, 0], progress=False)


def test_bad_ig_steps(model):
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="`ig_steps` must be an int"):
            edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=bad, progress=False)


def test_unknown_nodes_are_listed(model):
    circuit = Circuit(edges=[("embed", "a0.h9.q"), ("a7.h0", "logits"), ("embed", "logits")])
    with pytest.raises(KeyError, match=r"2 node\(s\).*'a0.h9.q'.*'a7.h0'"):
        evaluate(model, CLEAN, CORRUPTED, metric, circuit)
    with pytest.raises(ValueError, match="not edges"):
        evaluate(model, CLEAN, CORRUPTED, metric, Circuit(edges=[("a0.h1", "a0.h1.q")]))
    with pytest.raises(KeyError, match="`edges`"):
        exact_edge_effects(model, CLEAN, CORRUPTED, metric, [("embed", "nowhere")], progress=False)
    with pytest.raises(TypeError, match="must be a Circuit"):
        evaluate(model, CLEAN, CORRUPTED, metric, [("embed", "logits")])  # type: ignore[arg-type]


def test_faithfulness_needs_a_behaviour(model):
    with pytest.raises(ValueError, match="on both the clean and the corrupted inputs"):
        faithfulness(model, CLEAN, CLEAN, metric, Circuit())


# -- the model as it was found ------------------------------------------------------------------------------------
def _state(model):
    return (
        hook_state(model),
        [m.training for m in model.modules()],
        [(p.requires_grad, p.grad) for p in model.parameters()],
        torch.is_grad_enabled(),
    )


@pytest.mark.slow
def test_the_model_is_left_as_it_was_found(model):
    model.train()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    try:
        with torch.no_grad():
            reference = model.eval()(CLEAN).logits
        model.train()
        before = _state(model)
        scores = edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=2, progress=False)
        faithfulness_curve(model, CLEAN, CORRUPTED, metric, scores, [5, 10])
        exact_edge_effects(model, CLEAN, CORRUPTED, metric, [("embed", "a1.h0.q")], progress=False)
        assert _state(model) == before
        with torch.no_grad():
            assert torch.equal(model.eval()(CLEAN).logits, reference)
    finally:
        model.eval()
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
        model.lm_head.weight.grad = None


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["edges", "evaluate", "exact"])
def test_nothing_is_left_registered_after_an_error(model, error, where):
    before = _state(model)
    calls = []

    def failing(out):
        calls.append(1)
        if len(calls) == 2:  # the second forward: the clean run, or the patched run
            raise error("stop")
        return metric(out)

    calls_of = {
        "edges": lambda: edge_attribution(model, CLEAN, CORRUPTED, failing, progress=False),
        "evaluate": lambda: evaluate(model, CLEAN, CORRUPTED, failing, Circuit(edges=[("embed", "logits")])),
        "exact": lambda: exact_edge_effects(model, CLEAN, CORRUPTED, failing, [("embed", "logits")], progress=False),
    }
    with pytest.raises(error, match="stop"):
        calls_of[where]()
    assert _state(model) == before


def test_identical_inputs_warn_that_every_score_is_zero(model):
    with pytest.warns(UserWarning, match="every edge score is 0"):
        scores = edge_attribution(model, CLEAN, CLEAN, metric, progress=False)
    assert int((scores.scores == 0).sum()) == 82
