"""``nn.MultiheadAttention`` as self-attention under a backward capture: same path, gradients that add up."""

from __future__ import annotations

import torch
from torch import nn

from hooks import Recorder


def test_self_attention_keeps_its_output_and_its_qkv_gradients_sum_to_the_input_gradient():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    model = nn.Sequential(attn)
    h = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(2, 5, 8)  # an asymmetric loss, so that no gradient is accidentally symmetric

    out_ref = attn(h, h, h)[0]
    (grad_ref,) = torch.autograd.grad((out_ref * weight).sum(), h)
    with Recorder(model, "0", capture=("grad_input", "grad_output")) as rec:
        out = attn(h, h, h)[0]  # `query is key is value`: the packed in-projection
        (grad,) = torch.autograd.grad((out * weight).sum(), h)
    assert torch.equal(out, out_ref) and torch.equal(grad, grad_ref)
    q, k, v = rec["0"].grad_input
    torch.testing.assert_close(q + k + v, grad_ref, rtol=0, atol=0)


def test_distinct_query_key_value_each_get_their_own_gradient():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    q, k, v = (torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    with Recorder(nn.Sequential(attn), "0", capture="grad_input") as rec:
        attn(q, k, v)[0].pow(2).sum().backward()
    for got, tensor in zip(rec["0"].grad_input, (q, k, v), strict=True):
        torch.testing.assert_close(got, tensor.grad, rtol=0, atol=0)
