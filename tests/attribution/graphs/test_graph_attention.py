"""Frozen attention's batched backward: ``P^T @ dout`` for every row in one product, the rows unchanged (float64)."""

from __future__ import annotations

import pytest
import torch

import attribution.graphs._attention as attention
import attribution.graphs._frozen as frozen_module
from attribution.graphs import attribution_graph
from attribution.graphs._attention import _HeldMix
from attribution.graphs._math import value_gradients
from tests.attribution.models import lm64

IDS = torch.tensor([3, 7, 1, 9, 4, 2, 5, 11])


def _slow_value_gradients(probs, grads, heads, kv_heads):
    """``dV[r, k, g * D + d] = sum_{h in group g} sum_q P[h, q, k] dout[r, q, h * D + d]``, loop by loop."""
    rows, positions, width = grads.shape
    dim, group = width // heads, heads // kv_heads
    out = torch.zeros(rows, positions, kv_heads * dim, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            g = h // group
            for k in range(positions):
                for q in range(positions):
                    out[r, k, g * dim : (g + 1) * dim] += probs[0, h, q, k] * grads[r, q, h * dim : (h + 1) * dim]
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3), (4, 1)])
def test_value_gradients_is_the_transposed_product_summed_over_each_group(heads, kv_heads):
    torch.manual_seed(0)
    positions, dim, rows = 5, 3, 4
    probs = torch.softmax(torch.randn(1, heads, positions, positions, dtype=torch.float64), -1)
    grads = torch.randn(rows, positions, heads * dim, dtype=torch.float64)
    got = value_gradients(probs, grads, heads, kv_heads)
    torch.testing.assert_close(got, _slow_value_gradients(probs, grads, heads, kv_heads), rtol=1e-12, atol=1e-14)


def test_vmapped_rows_are_one_product_equal_to_each_rows_own_backward(monkeypatch):
    torch.manual_seed(1)
    heads, kv_heads, positions, dim, rows = 4, 2, 6, 3, 5
    probs = torch.softmax(torch.randn(1, heads, positions, positions, dtype=torch.float64), -1)
    values = torch.randn(1, positions, kv_heads * dim, dtype=torch.float64, requires_grad=True)
    per_head = values.reshape(1, positions, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    mixed = (probs @ per_head).transpose(1, 2).reshape(1, positions, heads * dim)
    out = _HeldMix.apply(mixed.detach(), values, probs, heads, kv_heads)
    assert torch.equal(out, mixed)  # the value is the model's own
    cotangents = torch.randn(rows, *out.shape, dtype=torch.float64)
    seen = []
    counted = lambda p, g, *a: seen.append(g.shape[0]) or value_gradients(p, g, *a)  # noqa: E731
    monkeypatch.setattr(attention, "value_gradients", counted)
    (batched,) = torch.func.vmap(lambda c: torch.autograd.grad(out, values, c, retain_graph=True))(cotangents)
    assert seen == [rows]  # one product for all rows: the vmap rule, not a copy of P per row
    for r in range(rows):
        (expected,) = torch.autograd.grad(mixed, values, cotangents[r], retain_graph=True)  # autograd's own
        torch.testing.assert_close(batched[r], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_graph_rows_equal_the_models_own_attention_backward(kind, monkeypatch):
    model = lm64(kind)  # llama, qwen2: 4 query heads on 2 key/value heads; gpt2: a fused qkv projection
    rewritten, rows = [], []
    original = frozen_module.batched_attention
    monkeypatch.setattr(frozen_module, "batched_attention", lambda *a: rewritten.append(original(*a)) or rewritten[-1])
    counted = lambda p, g, *a: rows.append(g.shape[0]) or value_gradients(p, g, *a)  # noqa: E731
    monkeypatch.setattr(attention, "value_gradients", counted)
    new = attribution_graph(model, IDS, progress=False, batch_size=16).adjacency.to_dense()
    assert rewritten == [{0, 1}]  # every layer took the batched backward
    assert max(rows) == 16  # a full batch's rows in one product
    monkeypatch.setattr(frozen_module, "batched_attention", lambda *a: set())  # autograd's backward through P @ V
    old = attribution_graph(model, IDS, progress=False, batch_size=16).adjacency.to_dense()
    assert old.abs().max() > 0.05
    assert float((new - old).abs().max()) <= 1e-10 * float(old.abs().max())


def test_a_layer_whose_output_is_not_p_at_v_keeps_the_models_backward(monkeypatch):
    model = lm64("llama")
    rewritten = []
    original = frozen_module.batched_attention
    monkeypatch.setattr(frozen_module, "batched_attention", lambda *a: rewritten.append(original(*a)) or rewritten[-1])
    monkeypatch.setattr(attention, "_mixed", lambda probs, v, heads, kv_heads: v.new_zeros(1))  # the check fails
    graph = attribution_graph(model, IDS, progress=False, batch_size=16)
    assert rewritten == [set()]
    monkeypatch.undo()
    expected = attribution_graph(model, IDS, progress=False, batch_size=16)
    torch.testing.assert_close(graph.adjacency.to_dense(), expected.adjacency.to_dense(), rtol=1e-10, atol=0)


def test_the_memory_estimate_bounds_the_measured_peak_without_counting_every_source_at_once():
    from types import SimpleNamespace

    from attribution.graphs.build import memory_estimate

    smollm2 = SimpleNamespace(hidden=576, n_heads=9)  # SmolLM2-135M: 30 layers of 1,536 neurons
    batch, kept, held = memory_estimate(smollm2, 1024, [1536] * 30, 0, 1000, 32, 8192, torch.float32)  # type: ignore[arg-type]
    # measured (benchmarks/graphs_speed.py): 6.96 GiB above the loaded model for a batch of 32 rows at 1,024 tokens
    assert 7.0 < (batch + kept + held) / 2**30 < 16.0
    wider, _, _ = memory_estimate(smollm2, 1024, [1536] * 29 + [3072], 0, 1000, 32, 8192, torch.float32)  # type: ignore[arg-type]
    more, _, _ = memory_estimate(smollm2, 1024, [1536] * 31, 0, 1000, 32, 8192, torch.float32)  # type: ignore[arg-type]
    per_row_layer = 1024 * 1536 * 32 * 4  # one more layer adds its cotangents, not all its sources' gradients too
    assert more - batch == per_row_layer and wider > more
