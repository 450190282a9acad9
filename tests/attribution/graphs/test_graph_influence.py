"""Influence against a dense power series; pruning against a dense re-implementation of circuit-tracer's prune_graph."""

from __future__ import annotations

import pytest
import torch

from attribution.graphs import AttributionGraph, Nodes
from attribution.graphs._math import _cumulative, find_threshold, partial_influence


def _dense_influence(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w ((I - N)^-1 - I)`` with ``N`` the row-normalised ``|A|``: the closed form of the power series."""
    a = adjacency.abs()
    n = a / a.sum(1, keepdim=True).clamp_min(1e-10)
    eye = torch.eye(len(a), dtype=torch.float64)
    return weights @ (torch.linalg.inv(eye - n) - eye)


def _dense_prune(adjacency, weights, n_features, n_tail, node_threshold, edge_threshold):
    """circuit-tracer 0.5's prune_graph, dense, re-written from its source (graph.py) for this test."""

    def normalize(m):
        m = m.abs()
        return m / m.sum(1, keepdim=True).clamp(min=1e-10)

    def influence(a, w):
        current = w @ a
        total = current.clone()
        while current.any():
            current = current @ a
            total += current
        return total

    def threshold(scores, t):
        ordered = torch.sort(scores, descending=True).values
        cumulative = torch.cumsum(ordered, 0) / ordered.sum()
        return ordered[min(int(torch.searchsorted(cumulative, t)), len(cumulative) - 1)]

    node_influence = influence(normalize(adjacency), weights)
    node_mask = node_influence >= threshold(node_influence, node_threshold)
    node_mask[-n_tail:] = True
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize(pruned)
    edge_scores = normalized * (influence(normalized, weights) + weights)[:, None]
    edge_mask = edge_scores >= threshold(edge_scores.flatten(), edge_threshold)
    old = node_mask.clone()
    node_mask[:-n_tail] &= edge_mask[:, :-n_tail].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not torch.equal(node_mask, old):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:-n_tail] &= edge_mask[:, :-n_tail].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    return node_mask, edge_mask & node_mask[:, None] & node_mask[None]


def test_influence_is_the_dense_power_series(llama_graph):
    dense = _dense_influence(llama_graph.adjacency.to_dense().double(), llama_graph.weights)
    torch.testing.assert_close(llama_graph.influence, dense, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(llama_graph.nodes.influence, dense, rtol=1e-10, atol=1e-14)
    nodes = llama_graph.nodes
    neurons = nodes.where("neuron")
    stranded = (nodes.layer[neurons] == 1) & (nodes.position[neurons] < 5)  # written after the last attention
    assert (dense[neurons][stranded] == 0).all()
    assert (dense[neurons][~stranded] > 0).all()


def _synthetic(seed: int, n_features: int = 30, n_tokens: int = 5, n_logits: int = 3) -> AttributionGraph:
    """A layered random graph with sparse, both-signed edges (features in 3 layers, then tokens, then logits)."""
    g = torch.Generator().manual_seed(seed)
    n = n_features + n_tokens + n_logits
    layer = torch.cat([torch.arange(n_features) % 3, torch.full((n_tokens,), -1), torch.full((n_logits,), 3)])
    a = torch.randn(n, n, generator=g, dtype=torch.float64) * (torch.rand(n, n, generator=g) < 0.4)
    a = a * (layer[:, None] > layer[None]) * (layer[:, None] >= 0)  # sources of earlier layers only
    kinds = ("neuron",) * n_features + ("token",) * n_tokens + ("logit",) * n_logits
    zeros = torch.zeros(n, dtype=torch.long)
    nodes = Nodes(kinds, layer, zeros, torch.arange(n), torch.ones(n, dtype=torch.float64), zeros.double())
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    return AttributionGraph(nodes, a.to_sparse(), torch.arange(n_tokens), probs, torch.full((3,), -1), 3, 10, None)


@pytest.mark.parametrize(("node_threshold", "edge_threshold"), [(0.8, 0.98), (0.5, 0.9), (0.95, 0.7), (1.0, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, None])
def test_pruning_is_circuit_tracers(node_threshold, edge_threshold, seed, llama_graph):
    if seed is None and node_threshold != 0.8:
        pytest.skip("the LM graph at the defaults only (a dense prune of 304 nodes per case)")
    for graph in (_synthetic(seed) if seed is not None else llama_graph,):
        dense = graph.adjacency.to_dense().double()
        n_features = len(graph.nodes.where("neuron"))
        node_mask, edge_mask = _dense_prune(dense, graph.weights, n_features, len(graph.nodes) - n_features,
                                            node_threshold, edge_threshold)  # fmt: skip
        pruned = graph.prune(node_threshold, edge_threshold)
        kept = node_mask.nonzero().flatten()
        assert torch.equal(pruned.nodes.index, graph.nodes.index[kept])
        expected = (dense * edge_mask)[kept][:, kept]
        assert torch.equal(pruned.adjacency.to_dense().double(), expected)
        assert pruned.node_threshold == node_threshold
        assert 0 < len(pruned.nodes) <= len(graph.nodes)


@pytest.mark.peers
def test_pruning_matches_circuit_tracer_itself(llama_graph):
    graph_module = pytest.importorskip("circuit_tracer.graph")
    n_features = len(llama_graph.nodes.where("neuron"))

    class Duck:  # what prune_graph reads of a circuit-tracer Graph
        def __init__(self) -> None:
            self.adjacency_matrix = llama_graph.adjacency.to_dense().double()
            self.input_tokens = llama_graph.tokens
            self.logit_targets = list(range(len(llama_graph.logit_weights)))
            self.selected_features = torch.arange(n_features)
            self.logit_probabilities = llama_graph.logit_weights.double()

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # its logit weights are made in the default dtype
    try:
        duck = Duck()
        node_mask, edge_mask, cumulative = graph_module.prune_graph(duck, 0.8, 0.98)
    finally:
        torch.set_default_dtype(default)
    pruned = llama_graph.prune(0.8, 0.98)
    kept = node_mask.nonzero().flatten()
    assert torch.equal(pruned.nodes.index, llama_graph.nodes.index[kept])
    dense = duck.adjacency_matrix
    assert torch.equal(pruned.adjacency.to_dense().double(), (dense * edge_mask)[kept][:, kept])
    torch.testing.assert_close(_cumulative(llama_graph.influence), cumulative)  # the graph file's "influence"


def test_find_threshold_pads_with_zeros_as_the_dense_vector_would():
    scores = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert float(find_threshold(scores, 0.79)) == 0.3
    assert float(find_threshold(scores, 1.0, size=3)) == 0.2  # no zeros: the last score
    assert float(find_threshold(scores * (1 - 1e-16), 1.0 + 1e-9, size=10)) == 0.0  # beyond the total: a zero


def test_partial_influence_follows_rows_through_their_nodes():
    # logit row (weight 0.6) reads neuron column 1 fully; neuron 1's row reads column 0 (a token) 3:1 with column 2
    groups = [(torch.tensor([0]), torch.tensor([[1]]), torch.tensor([[1.0]])),
              (torch.tensor([1]), torch.tensor([[0, 2]]), torch.tensor([[0.75, 0.25]]))]  # fmt: skip
    influence = partial_influence(groups, torch.tensor([-1, 1]), torch.tensor([0.6, 0.0]), 3)
    torch.testing.assert_close(influence, torch.tensor([0.45, 0.6, 0.15], dtype=torch.float64))
