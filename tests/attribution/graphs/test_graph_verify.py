"""verify: the real model's change (exact, through the patching hooks) and the graph's linear prediction."""

from __future__ import annotations

import pytest
import torch

from attribution.graphs import attribution_graph
from tests.attribution.graphs.conftest import IDS
from tests.attribution.graphs.reference import Reference
from tests.attribution.models import lm64


def _chosen(graph):
    neurons = graph.nodes.where("neuron")
    return neurons[torch.tensor([5, 30, 150, 200, 287])]  # two layers, several positions


def test_the_real_change_is_the_models_with_those_neurons_scaled(llama, llama_graph):
    chosen = _chosen(llama_graph)
    check = llama_graph.verify(llama, chosen, kind="steer", scale=-0.5)
    nodes = llama_graph.nodes
    hooks = []
    for layer in (0, 1):
        mine = chosen[nodes.layer[chosen] == layer]

        def scale(module, args, mine=mine):
            a = args[0].clone()
            a[0, nodes.position[mine], nodes.index[mine]] *= -0.5
            return (a,)

        hooks.append(llama.model.layers[layer].mlp.down_proj.register_forward_pre_hook(scale))
    try:
        with torch.no_grad():
            z = llama(IDS[None]).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    tokens = nodes.index[nodes.where("logit")]
    torch.testing.assert_close(check.real, (z[tokens] - z.mean()) - check.clean, rtol=0, atol=1e-12)
    assert check.real.abs().max() > 1e-6


@pytest.mark.slow
def test_the_prediction_is_the_frozen_models_total_derivative():
    """With every neuron a node, propagating relative changes through the edges is the chain rule (GPT-2: float64
    throughout; Llama's float32 RMSNorm would leave 1e-7 errors that dividing by small activations amplifies)."""
    model, ids = lm64("gpt2"), IDS[:4]
    graph = attribution_graph(model, ids, progress=False, batch_size=256)
    chosen = graph.nodes.where("neuron")[torch.tensor([5, 70, 130, 300, 400, 511])]
    eps = 1e-6
    check = graph.verify(model, chosen, kind="steer", scale=1 + eps)
    nodes = graph.nodes
    triples = [(int(nodes.layer[i]), int(nodes.position[i]), int(nodes.index[i])) for i in chosen]
    expected = Reference(model, ids, "gpt2").total_effect(triples, nodes.index[nodes.where("logit")])
    assert float(expected.abs().max()) > 1e-4
    torch.testing.assert_close(check.predicted / eps, expected, rtol=1e-5, atol=1e-9)
    one = chosen[3:4]  # alone, ablation is linear: minus the derivative
    single = Reference(model, ids, "gpt2").total_effect(triples[3:4], nodes.index[nodes.where("logit")])
    torch.testing.assert_close(graph.verify(model, one).predicted, -single, rtol=1e-9, atol=1e-13)


def test_verify_refuses_what_it_cannot_do(llama, llama_graph):
    with pytest.raises(ValueError, match="must be numbers of neuron, feature or error nodes"):
        llama_graph.verify(llama, [len(llama_graph.nodes) - 1])
    with pytest.raises(ValueError, match="leave `scale` at 0"):
        llama_graph.verify(llama, [0], scale=2.0)


def test_a_multiplied_node_passes_on_what_reaches_it_times_its_factor():
    from attribution.graphs._math import predicted_change

    # node 0 (a = 2) -> node 1 (a = 4): 3; node 1 -> logit 2: 5. Both neurons multiplied by 3.
    a = torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 5.0, 0.0]], dtype=torch.float64).to_sparse()
    got = predicted_change(a, torch.tensor([2.0, 4.0, 1.0]), torch.tensor([0, 1, 2]), torch.tensor([3.0, 3.0, 1.0]))
    # node 0: (3 - 1) 2 = 4; reaches node 1: 4 / 2 * 3 = 6; node 1: (3 - 1) 4 + 3 * 6 = 26; logit: 26 / 4 * 5
    assert got.tolist() == [4.0, 26.0, 32.5]
