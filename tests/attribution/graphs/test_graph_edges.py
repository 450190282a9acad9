"""Every edge equals the pinned definition: a Jacobian of the frozen model written out by hand (float64)."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from attribution.graphs import attribution_graph
from tests.attribution.graphs.conftest import IDS
from tests.attribution.graphs.reference import Reference
from tests.attribution.models import lm64

TOLERANCE = {"gpt2": 1e-10, "llama": 1e-6}  # Llama's RMSNorm runs in float32 (forward and LN-rule) inside float64


def _check(graph, model, kind, ids, rules) -> torch.Tensor:
    """Assert every entry of ``graph.adjacency`` against the reference; return the expected dense matrix."""
    reference = Reference(model, ids, kind, rules)
    torch.testing.assert_close(reference.clean_logits, reference.hf_logits, rtol=0, atol=1e-5)  # it is the model
    expected = reference.expected(graph.nodes, graph.nodes.index[graph.nodes.where("logit")], graph.foils)
    got = graph.adjacency.to_dense().double()
    largest = float(expected.abs().max())
    error = float((got - expected).abs().max())
    print(f"{kind} rules={rules}: max error {error / largest:.2e} of the largest entry {largest:.3g}")
    assert error <= TOLERANCE[kind] * largest
    nodes = graph.nodes
    neuron = nodes.where("neuron")
    layer, position = nodes.layer[neuron], nodes.position[neuron]
    causal = (position[:, None] >= nodes.position[None]) & (layer[:, None] > nodes.layer[None])  # tokens: layer -1
    assert torch.equal(expected[neuron] != 0, causal)  # every causal pair is an edge: not a trivial graph
    return expected


@pytest.mark.parametrize("rules", [None, "relp"])
def test_llama_every_edge_is_the_frozen_models_direct_effect(llama, llama_graph, rules):
    graph = llama_graph if rules is None else attribution_graph(llama, IDS, rules=rules, progress=False, batch_size=128)
    assert len(graph.nodes.where("neuron")) == 2 * len(IDS) * 24  # SiLU: every neuron is active, every one a node
    _check(graph, llama, "llama", IDS, rules)


@pytest.mark.slow
@pytest.mark.parametrize("rules", [None, "relp"])
def test_gpt2_every_edge_is_the_frozen_models_direct_effect_to_1e10(rules):
    model = lm64("gpt2")
    _check(attribution_graph(model, IDS, rules=rules, progress=False, batch_size=256), model, "gpt2", IDS, rules)


def test_relp_changes_the_neuron_rows_only(llama, llama_graph):
    relp = attribution_graph(llama, IDS, rules="relp", progress=False, batch_size=128)
    neurons = len(llama_graph.nodes.where("neuron"))
    gradient, rules = llama_graph.adjacency.to_dense(), relp.adjacency.to_dense()
    assert torch.equal(gradient[neurons:], rules[neurons:])  # logit rows: no nonlinearity at the target
    changed = (gradient[:neurons] - rules[:neurons]).abs().max() / gradient[:neurons].abs().max()
    assert changed > 0.1  # the identity and half rules are not the gradient


def test_logit_difference_targets_and_their_values(llama):
    graph = attribution_graph(llama, IDS, target=[(5, 9), (11, 2)], progress=False, batch_size=128)
    _check(graph, llama, "llama", IDS, None)
    with torch.no_grad():
        z = llama(IDS[None]).logits[0, -1]
    logits = graph.nodes.where("logit")
    assert graph.nodes.index[logits].tolist() == [5, 11]
    assert graph.foils.tolist() == [9, 2]
    torch.testing.assert_close(graph.nodes.activation[logits], torch.stack([z[5] - z[9], z[11] - z[2]]))
    assert graph.logit_weights.tolist() == [0.5, 0.5]


def test_logit_nodes_are_the_likely_tokens_with_their_value_and_probability(llama, llama_graph):
    with torch.no_grad():
        z = llama(IDS[None]).logits[0, -1]
    probs = z.softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    count = min(10, int((cumulative < 0.95).sum()) + 1)  # until 0.95 is reached, at most 10
    logits = llama_graph.nodes.where("logit")
    assert llama_graph.nodes.index[logits].tolist() == order[:count].tolist()
    torch.testing.assert_close(llama_graph.nodes.activation[logits], (z - z.mean())[order[:count]])
    torch.testing.assert_close(llama_graph.logit_weights, probs[order[:count]])
    assert (llama_graph.nodes.layer[logits] == 2).all()
    assert (llama_graph.nodes.position[logits] == len(IDS) - 1).all()


def test_single_token_target_and_node_table(llama):
    graph = attribution_graph(llama, IDS, target=17, progress=False, batch_size=128)
    last = graph.nodes[len(graph.nodes) - 1]
    assert (last.kind, last.layer, last.position, last.index) == ("logit", 2, 5, 17)
    tokens = graph.nodes.where("token")
    assert graph.nodes.index[tokens].tolist() == IDS.tolist()
    assert (graph.nodes.layer[tokens] == -1).all()
    assert graph.nodes.position[tokens].tolist() == list(range(len(IDS)))
    neurons = graph.nodes.where("neuron")
    embedded = llama.model.embed_tokens.weight[IDS].norm(dim=-1)
    torch.testing.assert_close(graph.nodes.activation[tokens], embedded.detach())
    layer, position, index = (graph.nodes.layer[neurons], graph.nodes.position[neurons], graph.nodes.index[neurons])
    assert torch.equal(torch.stack([layer, position, index]), torch.stack([layer, position, index]).unique(dim=1))
    mlp = llama.model.layers[1].mlp
    with torch.no_grad():
        seen = {}
        handle = mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("a", a[0]))
        llama(IDS[None])
        handle.remove()
    last_layer = neurons[layer == 1]
    expected = seen["a"][0, graph.nodes.position[last_layer], graph.nodes.index[last_layer]]
    torch.testing.assert_close(graph.nodes.activation[last_layer], expected.double())


def test_an_mlp_that_changes_its_input_first_gets_its_rows_at_the_neurons(llama):
    """The shortcut (a neuron's row injected at its MLP's input) needs the projections to read that input as it came."""
    doubled, folded = copy.deepcopy(llama), copy.deepcopy(llama)
    for layer in doubled.model.layers:  # x -> mlp(2 x)
        layer.mlp.forward = types.MethodType(lambda self, x: type(self).forward(self, 2 * x), layer.mlp)
    with torch.no_grad():
        for layer in folded.model.layers:  # the same function: 2 folded into the projections that read x
            layer.mlp.gate_proj.weight.mul_(2)
            layer.mlp.up_proj.weight.mul_(2)
    torch.testing.assert_close(doubled(IDS[None]).logits, folded(IDS[None]).logits, rtol=0, atol=1e-12)
    got = attribution_graph(doubled, IDS, progress=False, batch_size=128)
    expected = attribution_graph(folded, IDS, progress=False, batch_size=128)
    assert got.runs == 1 + math.ceil(288 / 128)  # no pass for the slopes: no layer takes the shortcut
    assert expected.runs == got.runs + 1
    a, b = got.adjacency.to_dense(), expected.adjacency.to_dense()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))
