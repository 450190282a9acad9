"""SAE and Transcoder: each activation's encode against a slow float64 formula written out element by element."""

from __future__ import annotations

import pytest
import torch

from attribution import SAE, Transcoder
from attribution.dictionaries import _math


def seeded(module, seed=0):
    """Random float64 weights of both signs (biases included), so that no term of a formula can hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return module


def slow_pre(x, w_enc, b_enc, b_dec=None):
    """(x - b_dec) @ W_enc + b_enc, one sum at a time."""
    x, w_enc, b_enc = x.detach(), w_enc.detach(), b_enc.detach()
    b_dec = None if b_dec is None else b_dec.detach()
    rows, n = x.shape[0], w_enc.shape[1]
    out = torch.zeros(rows, n, dtype=torch.float64)
    for r in range(rows):
        for j in range(n):
            total = float(b_enc[j])
            for i in range(x.shape[1]):
                total += (float(x[r, i]) - (float(b_dec[i]) if b_dec is not None else 0.0)) * float(w_enc[i, j])
            out[r, j] = total
    return out


def slow_topk(pre, k):
    out = torch.zeros_like(pre)
    for r in range(pre.shape[0]):
        ranked = sorted(range(pre.shape[1]), key=lambda j: -float(pre[r, j]))[:k]
        for j in ranked:
            out[r, j] = max(float(pre[r, j]), 0.0)
    return out


@pytest.fixture
def x():
    # row 1 is strongly negative, so that fewer than k of its pre-activations are positive
    return torch.tensor([[0.5, -1.0, 2.0, 0.3], [-9.0, -8.0, -7.0, -9.5], [1.5, 0.2, -0.4, 1.1]], dtype=torch.float64)


def test_relu_encode_decode_and_forward_match_the_formula(x):
    sae = seeded(SAE(4, 6, activation="relu").double())
    pre = slow_pre(x, sae.W_enc, sae.b_enc, sae.b_dec)
    f = sae.encode(x)
    torch.testing.assert_close(f, pre.clamp(min=0), rtol=0, atol=1e-12)
    assert (f == 0).any() and (f > 0).any()
    slow_decode = torch.stack([sum(f[r, j] * sae.W_dec[j] for j in range(6)) + sae.b_dec for r in range(3)])
    torch.testing.assert_close(sae.decode(f), slow_decode, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(x), slow_decode, rtol=0, atol=1e-12)


def test_topk_keeps_the_k_largest_relud_pre_activations_per_row(x):
    sae = seeded(SAE(4, 6, activation="topk", k=3).double(), seed=1)
    pre = slow_pre(x, sae.W_enc, sae.b_enc, sae.b_dec)
    f = sae.encode(x)
    torch.testing.assert_close(f, slow_topk(pre, 3), rtol=0, atol=1e-12)
    assert int((pre[1] > 0).sum()) < 3  # the row where topk without the ReLU would keep negative values
    assert (f >= 0).all() and int((f != 0).sum(-1).max()) <= 3


def test_jumprelu_is_pre_times_pre_above_the_threshold_strictly(x):
    sae = seeded(SAE(4, 6, activation="jumprelu").double(), seed=2)
    pre = slow_pre(x, sae.W_enc, sae.b_enc, sae.b_dec)
    exact = float(sae.pre(x)[0, 2].detach())  # the module's own value: equality is tested bitwise
    threshold = torch.tensor([0.1, -0.5, exact, 1.0, -100.0, 0.0], dtype=torch.float64)
    sae.threshold.copy_(threshold)
    f = sae.encode(x)
    expected = torch.tensor(
        [[float(pre[r, j]) if float(pre[r, j]) > float(threshold[j]) else 0.0 for j in range(6)] for r in range(3)],
        dtype=torch.float64,
    )
    expected[0, 2] = 0.0
    torch.testing.assert_close(f, expected, rtol=0, atol=1e-12)
    assert f[0, 2] == 0  # equal to its threshold: off (strict >)
    assert (f < 0).any()  # a negative threshold lets negative pre-activations through, as the formula says


def test_batchtopk_uses_its_scalar_threshold_at_inference_and_the_batch_rule_in_training(x):
    sae = seeded(SAE(4, 6, activation="batchtopk", k=2).double(), seed=3)
    pre = slow_pre(x, sae.W_enc, sae.b_enc, sae.b_dec)
    sae.threshold.fill_(0.7)
    expected = torch.where(pre > 0.7, pre.clamp(min=0), torch.zeros_like(pre))
    torch.testing.assert_close(sae.encode(x), expected, rtol=0, atol=1e-12)
    # the training rule: the k * rows = 6 largest ReLU'd values over the whole batch
    flat = sorted(((float(pre[r, j]), r, j) for r in range(3) for j in range(6)), reverse=True)[:6]
    hand = torch.zeros_like(pre)
    for value, r, j in flat:
        hand[r, j] = max(value, 0.0)
    torch.testing.assert_close(_math.batch_topk(pre, 2), hand, rtol=0, atol=0)
    assert sorted(int((hand[r] != 0).sum()) for r in range(3)) != [2, 2, 2]  # not per-row top-k


def test_an_sae_that_does_not_subtract_b_dec(x):
    sae = seeded(SAE(4, 6, activation="relu", subtract_b_dec=False).double(), seed=4)
    torch.testing.assert_close(sae.encode(x), slow_pre(x, sae.W_enc, sae.b_enc).clamp(min=0), rtol=0, atol=1e-12)


def test_transcoder_encodes_without_b_dec_and_adds_its_skip(x):
    tc = seeded(Transcoder(4, 3, 6, activation="topk", k=2, skip=True).double(), seed=5)
    f = tc.encode(x)
    torch.testing.assert_close(f, slow_topk(slow_pre(x, tc.W_enc, tc.b_enc), 2), rtol=0, atol=1e-12)
    expected = torch.stack([sum(f[r, j] * tc.W_dec[j] for j in range(6)) + tc.b_dec for r in range(3)])
    expected = expected + torch.stack([sum(x[r, i] * tc.W_skip[i] for i in range(4)) for r in range(3)])
    torch.testing.assert_close(tc(x), expected, rtol=0, atol=1e-12)
    assert tc(x).shape == (3, 3) and tc.d_in == 4 and tc.d_out == 3 and tc.n_features == 6


def test_init_has_unit_decoder_rows_and_a_tied_encoder():
    torch.manual_seed(0)
    sae = SAE(8, 32, activation="relu")
    assert sae.W_enc.dtype == torch.float32
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(32))
    assert torch.equal(sae.W_enc, sae.W_dec.T) and not sae.b_enc.any() and not sae.b_dec.any()


def test_bad_arguments_and_widths_are_refused_with_what_came():
    with pytest.raises(ValueError, match="`activation` must be one of"):
        SAE(4, 8, activation="gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`k` must be a positive int"):
        SAE(4, 8, activation="topk", k=0)
    with pytest.raises(ValueError, match="`n_features` must be a positive int"):
        SAE(4, 0)
    with pytest.raises(ValueError, match=r"d_in=4.*\(2, 5\) \(width 5\)"):
        SAE(4, 8).encode(torch.randn(2, 5))
