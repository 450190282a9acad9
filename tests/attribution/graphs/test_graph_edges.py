"""Every edge equals the pinned definition: a Jacobian of the frozen model written out by hand (float64)."""

from __future__ import annotations

import pytest
import torch

from attribution.graphs import attribution_graph
from tests.attribution.graphs.reference import Reference
from tests.attribution.models import lm64

IDS = torch.tensor([3, 7, 1, 9, 4, 2])
TOLERANCE = {"gpt2": 1e-10, "llama": 1e-6}  # Llama's RMSNorm runs in float32 (forward and LN-rule) inside float64


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return lm64(kind)


@pytest.mark.parametrize("rules", [None, "relp"])
def test_every_edge_is_the_frozen_models_direct_effect(model, kind, rules):
    graph = attribution_graph(model, IDS, rules=rules, progress=False)
    reference = Reference(model, IDS, kind, rules)
    # the hand-written forward is the model's own
    torch.testing.assert_close(reference.clean_logits, reference.hf_logits, rtol=0, atol=1e-5)
    logits = graph.nodes.where("logit")
    expected = reference.expected(graph.nodes, graph.nodes.index[logits], graph.foils)
    got = graph.adjacency.to_dense().double()
    largest = float(expected.abs().max())
    error = float((got - expected).abs().max())
    print(f"{kind} rules={rules}: max error {error / largest:.2e} of the largest entry {largest:.3g}")
    assert error <= TOLERANCE[kind] * largest
    assert int((expected != 0).sum()) > 0.3 * expected.numel() / 2  # a dense lower triangle, not a trivial graph
