"""A dictionary basis: features and error nodes in place of an MLP's neurons, every edge against the frozen model.

The dictionaries are float64 with every parameter random (biases too, a JumpReLU's thresholds), so that no term of
the pinned definition can vanish by accident: an SAE on the MLP's output (TopK or ReLU), a transcoder from the MLP's
input to its output with a linear skip (JumpReLU or ReLU).
"""

from __future__ import annotations

import math

import pytest
import torch

from attribution import SAE, Transcoder
from attribution.graphs import AttributionGraph, Nodes, attribution_graph
from tests.attribution.graphs.conftest import IDS
from tests.attribution.graphs.reference import Reference
from tests.attribution.graphs.test_graph_influence import _dense_prune
from tests.attribution.graphs.test_graph_search import _count_engine_runs
from tests.attribution.models import lm64
from tests.support import hook_state

TOLERANCE = {"gpt2": 1e-10, "llama": 1e-6}  # Llama's RMSNorm runs in float32 (forward and LN-rule) inside float64


def _random(dictionary, seed: int):
    """``dictionary`` in float64 with every parameter drawn from a seeded normal (thresholds uniform in [0, 0.1])."""
    generator = torch.Generator().manual_seed(seed)
    dictionary = dictionary.double()
    with torch.no_grad():
        for p in dictionary.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * (0.5 if p.dim() == 2 else 0.1))
        if dictionary.activation == "jumprelu":
            dictionary.threshold.copy_(torch.rand(dictionary.n_features, generator=generator, dtype=torch.float64) / 10)
    return dictionary


def _dictionary(name: str):
    return {
        "sae-topk": lambda: _random(SAE(16, 40, activation="topk", k=6), 1),
        "sae-relu": lambda: _random(SAE(16, 40, activation="relu", subtract_b_dec=False), 2),
        "transcoder-jumprelu": lambda: _random(Transcoder(16, 16, 40, activation="jumprelu", skip=True), 3),
        "transcoder-relu": lambda: _random(Transcoder(16, 16, 40, activation="relu", skip=True), 4),
    }[name]()


def _mlp(kind: str, layer: int) -> str:
    return f"model.layers.{layer}.mlp" if kind == "llama" else f"transformer.h.{layer}.mlp"


@pytest.fixture(scope="module")
def gpt2():
    return lm64("gpt2")


def _check(graph, model, kind, basis, rules) -> torch.Tensor:
    """Assert every entry of ``graph.adjacency`` against the reference; return the expected dense matrix."""
    reference = Reference(model, IDS, kind, rules, basis)
    torch.testing.assert_close(reference.clean_logits, reference.hf_logits, rtol=0, atol=1e-5)  # it is the model
    expected = reference.expected(graph.nodes, graph.nodes.index[graph.nodes.where("logit")], graph.foils)
    got = graph.adjacency.to_dense().double()
    largest = float(expected.abs().max())
    error = float((got - expected).abs().max())
    print(f"{kind} {sorted(basis)} rules={rules}: max error {error / largest:.2e} of the largest entry {largest:.3g}")
    assert error <= TOLERANCE[kind] * largest
    nodes = graph.nodes
    units = torch.cat([nodes.where("neuron"), nodes.where("feature")])
    layer, position = nodes.layer[units], nodes.position[units]
    sources = torch.tensor([k != "logit" for k in nodes.kind])
    causal = (position[:, None] >= nodes.position[None]) & (layer[:, None] > nodes.layer[None]) & sources[None]
    assert torch.equal(expected[units] != 0, causal)  # every causal pair is an edge: not a trivial graph
    for sourceless in ("error", "token"):
        assert not got[nodes.where(sourceless)].any()  # no incoming edges
    return expected


CASES = [
    ({0: "sae-topk", 1: "transcoder-jumprelu"}, None),  # feature -> feature, error -> feature
    ({0: "sae-topk", 1: "transcoder-jumprelu"}, "relp"),
    ({1: "sae-relu"}, None),  # neuron -> feature
    ({0: "transcoder-relu"}, "relp"),  # feature -> neuron, error -> neuron
]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize(("names", "rules"), CASES)
def test_every_feature_and_error_edge_is_the_replacement_models_direct_effect(request, kind, names, rules):
    model = request.getfixturevalue(kind)
    basis = {layer: _dictionary(name) for layer, name in names.items()}
    graph = attribution_graph(model, IDS, basis={_mlp(kind, layer): d for layer, d in basis.items()}, rules=rules,
                              progress=False, batch_size=128)  # fmt: skip
    assert len(graph.nodes.where("feature")) > 20 and len(graph.nodes.where("error")) == len(basis) * len(IDS)
    assert set(graph.nodes.layer[graph.nodes.where("feature")].tolist()) == set(basis)
    assert set(graph.nodes.layer[graph.nodes.where("neuron")].tolist()) == {0, 1} - set(basis)
    _check(graph, model, kind, basis, rules)


def _recorded(model, names):
    """Each MLP's input and output in a plain forward."""
    seen, handles = {}, []
    for name in names:

        def hook(module, args, out, name=name):
            seen[name] = (args[0].detach(), out.detach())

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(IDS[None])
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_feature_nodes_are_the_active_features_and_error_nodes_the_mlp_output_minus_the_reconstruction(gpt2):
    basis = {_mlp("gpt2", 0): _dictionary("sae-topk"), _mlp("gpt2", 1): _dictionary("transcoder-jumprelu")}
    graph = attribution_graph(gpt2, IDS, basis=basis, progress=False, batch_size=128)
    seen = _recorded(gpt2, basis)
    nodes = graph.nodes
    expected_features, expected_errors = [], []
    for layer, (name, d) in enumerate(basis.items()):
        x, y = seen[name]
        source = y if isinstance(d, SAE) else x
        with torch.no_grad():
            f, error = d.encode(source)[0], (y - d(source))[0]  # the reconstruction: decode(encode), + skip
        for position, index in f.nonzero().tolist():
            expected_features.append((layer, position, index, float(f[position, index])))
        for position in range(len(IDS)):
            expected_errors.append((layer, position, -1, float(error[position].norm())))
    for kind, expected in (("feature", expected_features), ("error", expected_errors)):
        where = nodes.where(kind)
        got = list(zip(nodes.layer[where].tolist(), nodes.position[where].tolist(), nodes.index[where].tolist(),
                       nodes.activation[where].tolist(), strict=True))  # fmt: skip
        assert [g[:3] for g in got] == [e[:3] for e in expected]  # in order: layer, position, index
        torch.testing.assert_close(torch.tensor([g[3] for g in got]), torch.tensor([e[3] for e in expected]),
                                   rtol=1e-12, atol=1e-14)  # fmt: skip
    kinds = list(nodes.kind)
    assert kinds == sorted(kinds, key=["feature", "error", "token", "logit"].index)  # circuit-tracer's order
    assert min(e[3] for e in expected_errors) > 0.1  # random dictionaries: far from exact


def _exact_sae(width: int) -> SAE:
    """An SAE that reconstructs exactly: features relu(y) and relu(-y), decoder rows +e_i and -e_i."""
    sae = SAE(width, 2 * width, activation="relu").double()
    eye = torch.eye(width, dtype=torch.float64)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def test_an_exact_dictionary_gives_the_neuron_graphs_logits_and_the_same_total_write(llama, llama_graph):
    """relu(y) - relu(-y) = y: no error, and per position the features write what the neurons write."""
    graph = attribution_graph(llama, IDS, basis={"model.layers.0.mlp": _exact_sae(16)}, progress=False, batch_size=128)
    nodes, plain = graph.nodes, llama_graph.nodes
    logits, plain_logits = nodes.where("logit"), plain.where("logit")
    assert torch.equal(nodes.index[logits], plain.index[plain_logits])
    assert torch.equal(nodes.activation[logits], plain.activation[plain_logits])  # bitwise: the forward is the model's
    assert torch.equal(graph.logit_weights, llama_graph.logit_weights)
    errors = nodes.where("error")
    assert len(errors) == len(IDS) and not nodes.activation[errors].any()
    a, b = graph.adjacency.to_dense(), llama_graph.adjacency.to_dense()
    assert not a[:, errors].any()  # a zero error writes nothing
    # targets both graphs share: the layer-1 neurons (in the same order) and the logits
    targets = torch.cat([nodes.where("neuron"), logits])
    plain_targets = torch.cat([plain.where("neuron")[plain.layer[plain.where("neuron")] == 1], plain_logits])
    tokens, plain_tokens = nodes.where("token"), plain.where("token")
    torch.testing.assert_close(a[targets][:, tokens], b[plain_targets][:, plain_tokens], rtol=1e-12, atol=1e-15)
    features = nodes.where("feature")
    plain_neurons = plain.where("neuron")[plain.layer[plain.where("neuron")] == 0]
    for position in range(len(IDS)):  # the features' edges sum to the neurons' (Llama's down_proj has no bias)
        mine = features[nodes.position[features] == position]
        theirs = plain_neurons[plain.position[plain_neurons] == position]
        torch.testing.assert_close(a[targets][:, mine].sum(1), b[plain_targets][:, theirs].sum(1), rtol=1e-9,
                                   atol=1e-12)  # fmt: skip
    assert len(features) == 16 * len(IDS)  # one of relu(y), relu(-y) per coordinate


def test_relp_changes_what_runs_through_the_mlp_only(llama):
    """An SAE's feature reads the live MLP (RelP's rules there); a transcoder's feature and the logits do not."""
    basis = {"model.layers.0.mlp": _dictionary("sae-topk"), "model.layers.1.mlp": _dictionary("transcoder-jumprelu")}
    gradient = attribution_graph(llama, IDS, basis=basis, progress=False, batch_size=128)
    relp = attribution_graph(llama, IDS, basis=basis, rules="relp", progress=False, batch_size=128)
    g, r = gradient.adjacency.to_dense(), relp.adjacency.to_dense()
    nodes = gradient.nodes
    features = nodes.where("feature")
    sae, transcoder = features[nodes.layer[features] == 0], features[nodes.layer[features] == 1]
    assert ((g[sae] - r[sae]).abs().max() / g[sae].abs().max()) > 0.1  # the identity and half rules in the MLP
    assert torch.equal(r[transcoder], g[transcoder])  # the identity rule f / pre is the mask: the gradient
    assert torch.equal(g[nodes.where("logit")], r[nodes.where("logit")])


@pytest.mark.parametrize(("max_nodes", "batch_size"), [(None, 64), (30, 7)])
def test_autograd_runs_and_max_nodes_count_features(llama, monkeypatch, max_nodes, batch_size):
    runs = _count_engine_runs(monkeypatch)
    basis = {"model.layers.1.mlp": _dictionary("sae-relu")}
    graph = attribution_graph(llama, IDS, basis=basis, max_nodes=max_nodes, batch_size=batch_size, progress=False)
    units = len(graph.nodes.where("neuron")) + len(graph.nodes.where("feature"))
    active = 144 + int((graph.nodes.activation[graph.nodes.where("feature")] != 0).sum())
    assert units == (max_nodes or active)
    assert len(graph.nodes.where("error")) == len(IDS)  # errors are always nodes, and not counted
    logits = len(graph.nodes.where("logit"))
    slopes = len(graph.nodes.where("neuron")) > 0  # one pass reads the neurons' slopes (at their MLPs' inputs)
    assert runs[0] == graph.runs == math.ceil(logits / batch_size) + math.ceil(units / batch_size) + slopes
    assert runs[0] <= math.ceil((units + logits) / batch_size) + 2


def test_a_module_key_is_its_name_and_a_pruned_graph_keeps_features_and_errors(llama):
    sae = _dictionary("sae-topk")
    by_name = attribution_graph(llama, IDS, basis={"model.layers.0.mlp": sae}, progress=False, batch_size=128)
    by_module = attribution_graph(llama, IDS, basis={llama.model.layers[0].mlp: sae}, progress=False, batch_size=128)
    assert torch.equal(by_name.adjacency.to_dense(), by_module.adjacency.to_dense())
    assert list(by_name.basis) == ["model.layers.0.mlp"] and by_name.basis["model.layers.0.mlp"] is sae
    assert by_name.units == (sae.n_features, 24) and by_name.width == 24
    pruned = by_name.prune(0.95, 0.99)
    assert {"feature", "error"} <= set(pruned.nodes.kind)
    kinds = list(pruned.nodes.kind)
    assert kinds == sorted(kinds, key=["neuron", "feature", "error", "token", "logit"].index)


@pytest.mark.parametrize(("node_threshold", "edge_threshold"), [(0.8, 0.98), (0.95, 0.99)])
def test_pruning_is_circuit_tracers_with_errors_that_need_only_an_outgoing_edge(llama, node_threshold, edge_threshold):
    graph = attribution_graph(llama, IDS, basis={"model.layers.0.mlp": _dictionary("sae-topk")}, progress=False,
                              batch_size=128)  # fmt: skip
    dense = graph.adjacency.to_dense().double()
    units = len(graph.nodes.where("neuron")) + len(graph.nodes.where("feature"))
    tail = len(graph.nodes.where("token")) + len(graph.nodes.where("logit"))
    node_mask, edge_mask = _dense_prune(dense, graph.weights, units, tail, node_threshold, edge_threshold)
    pruned = graph.prune(node_threshold, edge_threshold)
    kept = node_mask.nonzero().flatten()
    assert "error" in pruned.nodes.kind and "feature" in pruned.nodes.kind
    assert pruned.nodes.kind == tuple(graph.nodes.kind[i] for i in kept.tolist())
    assert torch.equal(pruned.nodes.index, graph.nodes.index[kept])
    assert torch.equal(pruned.adjacency.to_dense().double(), (dense * edge_mask)[kept][:, kept])


def test_pruning_drops_a_feature_without_inputs_but_keeps_an_error_without_them():
    # feature 0 reads the token; feature 1 and the error read nothing; the logit reads both features and the error
    kinds = ("feature", "feature", "error", "token", "logit")
    a = torch.zeros(5, 5, dtype=torch.float64)
    a[0, 3] = a[4, 0] = a[4, 1] = a[4, 2] = 1.0
    layer, zeros = torch.tensor([0, 0, 0, -1, 1]), torch.zeros(5, dtype=torch.long)
    ones = torch.ones(5, dtype=torch.float64)
    nodes = Nodes(kinds, layer, zeros, torch.tensor([3, 4, -1, 7, 9]), ones, zeros.double())
    graph = AttributionGraph(nodes, a.to_sparse(), torch.tensor([7]), torch.ones(1, dtype=torch.float64),
                             torch.tensor([-1]), 1, 8, None)  # fmt: skip
    assert graph.influence.tolist() == [1 / 3, 1 / 3, 1 / 3, 1 / 3, 0.0]
    pruned = graph.prune(1.0, 1.0)  # every node and every edge carries influence: only the rule for sources acts
    assert pruned.nodes.kind == ("feature", "error", "token", "logit")
    assert pruned.nodes.index.tolist() == [3, -1, 7, 9]


def test_the_graph_file_the_page_and_the_picture_show_features_and_errors(llama, tmp_path):
    sae = _dictionary("sae-topk")
    graph = attribution_graph(llama, IDS, basis={"model.layers.1.mlp": sae}, progress=False, batch_size=128)
    pruned = graph.prune(0.9, 0.99)
    content = pruned.to_json(tmp_path / "g.json")
    written = {n["node_id"]: n for n in content["nodes"]}
    errors = [n for n in content["nodes"] if n["feature_type"] == "mlp reconstruction error"]
    assert errors and all(n["node_id"] == f"1_-1_{n['ctx_idx']}" and n["feature"] == -1 for n in errors)
    assert any(n["clerp"].startswith("L1 feature") for n in content["nodes"])
    assert len(written) == len(content["nodes"])  # ids are unique
    assert all(link["source"] in written and link["target"] in written for link in content["links"])
    page = pruned.to_html()
    assert '"kind": "feature"' in page and '"kind": "error"' in page and '"label": "L1/error"' in page
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ax = pruned.plot()
    assert {"feature", "error"} <= {text.get_text() for text in ax.get_legend().get_texts()}
    matplotlib.pyplot.close(ax.figure)
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    models.Model(**content)


def test_verify_scales_features_and_errors_in_the_spliced_model(gpt2):
    """The real run scales the live features and errors (splice's sites): hooks written by hand do the same."""
    sae, transcoder = _dictionary("sae-topk"), _dictionary("transcoder-jumprelu")
    graph = attribution_graph(gpt2, IDS, basis={_mlp("gpt2", 0): sae, _mlp("gpt2", 1): transcoder}, progress=False,
                              batch_size=128)  # fmt: skip
    nodes = graph.nodes
    features, errors = nodes.where("feature"), nodes.where("error")
    late = features[(nodes.layer[features] == 1) & (nodes.position[features] >= 2)][[0, 3]]
    chosen = torch.cat([late, errors[[1, 2]]])  # two layer-1 features, the layer-0 errors at positions 1 and 2
    assert nodes.position[chosen[2:]].tolist() == [1, 2] and (nodes.layer[chosen[2:]] == 0).all()
    check = graph.verify(gpt2, chosen, kind="steer", scale=-0.5)
    rows = [(int(nodes.position[i]), int(nodes.index[i])) for i in late]

    def layer0(module, args, y):  # the error y - sae(y), at positions 1 and 2, times -0.5
        return y + torch.nn.functional.pad(-1.5 * (y - sae(y))[:, 1:3], (0, 0, 1, len(IDS) - 3))

    def layer1(module, args, y):  # the live features (their input moved), times -0.5
        f = transcoder.encode(args[0])
        y = y.clone()
        for position, index in rows:
            y[0, position] += -1.5 * f[0, position, index] * transcoder.W_dec[index]
        return y

    handles = [gpt2.transformer.h[0].mlp.register_forward_hook(layer0)]
    handles.append(gpt2.transformer.h[1].mlp.register_forward_hook(layer1))
    try:
        with torch.no_grad():
            z = gpt2(IDS[None]).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    tokens = nodes.index[nodes.where("logit")]
    torch.testing.assert_close(check.real, (z[tokens] - z.mean()) - check.clean, rtol=0, atol=1e-12)
    assert check.real.abs().max() > 1e-3
    with pytest.raises(ValueError, match="must be numbers of neuron, feature or error nodes"):
        graph.verify(gpt2, nodes.where("token")[:1])


def test_the_prediction_is_the_replacement_models_total_derivative(gpt2):
    """With every node in the graph, the graph's propagation is the chain rule through the frozen replacement model."""
    ids = IDS[:4]
    sae, transcoder = _dictionary("sae-topk"), _dictionary("transcoder-jumprelu")
    basis = {0: sae, 1: transcoder}
    graph = attribution_graph(gpt2, ids, basis={_mlp("gpt2", i): d for i, d in basis.items()}, progress=False,
                              batch_size=256)  # fmt: skip
    nodes = graph.nodes
    features, errors = nodes.where("feature"), nodes.where("error")
    chosen = torch.cat([features[:: max(1, len(features) // 6)], errors[[0, 5]]])
    eps = 1e-6
    check = graph.verify(gpt2, chosen, kind="steer", scale=1 + eps)
    triples = [(int(nodes.layer[i]), int(nodes.position[i]), int(nodes.index[i])) for i in chosen]
    expected = Reference(gpt2, ids, "gpt2", None, basis).total_effect(triples, nodes.index[nodes.where("logit")])
    assert float(expected.abs().max()) > 1e-4
    torch.testing.assert_close(check.predicted / eps, expected, rtol=1e-5, atol=1e-9)


def test_the_model_and_the_dictionaries_are_left_as_found_also_after_an_error(llama):
    sae, transcoder = _dictionary("sae-topk"), _dictionary("transcoder-jumprelu")
    basis = {"model.layers.0.mlp": sae, "model.layers.1.mlp": transcoder}
    weights = {n: p.detach().clone() for d in (sae, transcoder) for n, p in d.named_parameters(prefix=str(id(d)))}
    transcoder.W_skip.requires_grad_(False)
    llama.train()
    before = hook_state(llama)
    try:
        with torch.no_grad():
            attribution_graph(llama, IDS, basis=basis, max_nodes=8, batch_size=4, progress=False)
            assert not torch.is_grad_enabled()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            attribution_graph(llama, IDS, basis=basis, target=[999], progress=False)  # raised inside the run
        assert hook_state(llama) == before
        assert llama.training and all(m.training for m in llama.modules())
        assert all(p.requires_grad and p.grad is None for p in llama.parameters())
        assert not any(hasattr(m, "dictionary") for m in llama.modules())
        for d in (sae, transcoder):
            for n, p in d.named_parameters(prefix=str(id(d))):
                assert torch.equal(p, weights[n]) and p.grad is None
                assert p.requires_grad == (p is not transcoder.W_skip)
    finally:
        llama.eval()


@pytest.mark.parametrize(
    ("basis", "error", "match"),
    [
        ("features", ValueError, r"`basis` must be 'neurons' .* or a mapping"),
        ({"model.layers.0.self_attn": "sae"}, ValueError,
         r"not an MLP of LlamaForCausalLM.*\. A .* one of its MLPs: 'model.layers.0.mlp', 'model.layers.1.mlp'"),
        ({"model.layers.0.mlpp": "sae"}, ValueError, r"LlamaForCausalLM \(did you mean 'model.layers.0.mlp'\?\)\. A"),
        ({"model.layers.0.mlp": torch.nn.Linear(16, 16)}, TypeError, r"must be an SAE or a Transcoder; got Linear"),
        ({"model.layers.0.mlp": SAE(12, 40)}, ValueError,
         r"`basis`\['model.layers.0.mlp'\]: the SAE has d_in=12, but the MLP's output there has width 16"),
        ({"model.layers.0.mlp": SAE(24, 40)}, ValueError,  # one trained on the neurons (the MLP's inner width)
         r"`basis`\['model.layers.0.mlp'\]: the SAE has d_in=24, but the MLP's output there has width 16"),
        ({"model.layers.1.mlp": Transcoder(12, 16, 40)}, ValueError,
         r"the Transcoder has d_in=12, but the MLP's input there has width 16"),
        ({"model.layers.1.mlp": Transcoder(16, 20, 40)}, ValueError,
         r"the Transcoder has d_out=20, but the MLP's output there has width 16"),
    ],
)  # fmt: skip
def test_bad_bases_say_what_was_expected(llama, basis, error, match):
    if isinstance(basis, dict):
        basis = {k: _dictionary("sae-topk") if v == "sae" else v for k, v in basis.items()}
    with pytest.raises(error, match=match):
        attribution_graph(llama, IDS, basis=basis, progress=False)


def test_one_mlp_named_twice_is_refused(llama):
    sae = _dictionary("sae-topk")
    with pytest.raises(ValueError, match=r"names 'model\.layers\.0\.mlp' twice"):
        attribution_graph(llama, IDS, basis={"model.layers.0.mlp": sae, llama.model.layers[0].mlp: sae})
