"""Sparse TopK / BatchTopK training: the sparse encoder backward and decoder equal the dense ones in float64, pass
gradcheck, and train step by step as the dense path does."""

from __future__ import annotations

import pytest
import torch

from attribution import SAE, Transcoder, train_dictionary
from attribution.dictionaries import _math, _sparse
from attribution.dictionaries import train as train_module

EXACT = {"rtol": 0.0, "atol": 1e-12}  # float64: only the order of the sums differs


def dictionary(kind: str, k: int = 3) -> SAE | Transcoder:
    """A float64 dictionary with every parameter random and asymmetric, half its encoder biases negative."""
    torch.manual_seed(0)
    made = {
        "sae": lambda: SAE(6, 20, k=k),
        "sae-no-subtract": lambda: SAE(6, 20, k=k, subtract_b_dec=False),
        "transcoder": lambda: Transcoder(6, 5, 20, k=k),
    }[kind]().double()
    with torch.no_grad():
        for p in made.parameters():
            p.copy_(torch.randn_like(p) * 0.7 + 0.1)
        made.b_enc.copy_(-(torch.rand_like(made.b_enc) + 0.5))
        made.b_enc[[3, 11]] = torch.tensor([0.8, 0.4], dtype=torch.float64)  # pre = b_enc: 2 positive entries
    return made


def dense_and_sparse(made, x, y, pattern_of, dense_of, weights):
    """The loss ``sum(weights * (y - x_hat)^2)`` and the gradients of every parameter, dense and sparse."""
    results = []
    for sparse in (False, True):
        made.zero_grad(set_to_none=True)
        if sparse:
            enc_in = made.encoder_input(x)
            pre = (enc_in @ made.W_enc + made.b_enc).detach()
            pattern = pattern_of(pre)
            values = torch.relu(_sparse.gathered(pre, enc_in, made.W_enc, made.b_enc, pattern))
            x_hat = _sparse.decode(values, pattern, made.W_dec) + made.b_dec
        else:
            x_hat = dense_of(made.pre(x)) @ made.W_dec + made.b_dec
        loss = (weights * (y - x_hat).pow(2)).sum()
        loss.backward()
        results.append((x_hat.detach(), {n: p.grad.clone() for n, p in made.named_parameters()}))
    return results


PATTERNS = {
    "topk": (lambda pre: _sparse.topk_pattern(pre, 3), lambda pre: _math.topk(pre, 3)),
    "batchtopk": (lambda pre: _sparse.batch_topk_pattern(pre, 3), lambda pre: _math.batch_topk(pre, 3)),
    "dead-topk": (
        lambda pre: _sparse.dead_topk_pattern(pre, torch.arange(20) % 3 == 1, 4),
        lambda pre: _math.auxiliary_topk(pre, torch.arange(20) % 3 == 1, 4),
    ),
}


@pytest.mark.parametrize("kind", ["sae", "sae-no-subtract", "transcoder"])
@pytest.mark.parametrize("which", list(PATTERNS))
def test_the_sparse_forward_and_every_gradient_equal_the_dense_ones_in_float64(kind, which):
    made = dictionary(kind)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64) * 2 - 0.3
    x[4] = made.b_dec.detach() if kind == "sae" else 0.0  # encoder_input(x[4]) = 0: pre = b_enc
    y = x if kind != "transcoder" else torch.randn(9, 5, generator=g, dtype=torch.float64)
    weights = torch.rand(y.shape, generator=g, dtype=torch.float64) + 0.5  # every output weighs differently
    pattern_of, dense_of = PATTERNS[which]
    positive = (made.pre(x) > 0).sum(-1)
    assert int(positive[4]) == 2 and int(positive.max()) > 4  # a row whose top 3 include a non-positive entry
    (dense_out, dense_grads), (sparse_out, sparse_grads) = dense_and_sparse(made, x, y, pattern_of, dense_of, weights)
    torch.testing.assert_close(sparse_out, dense_out, **EXACT)
    for name, grad in dense_grads.items():
        assert grad.abs().max() > 0, name  # every parameter is reached (W_enc and b_enc through the active entries)
        torch.testing.assert_close(sparse_grads[name], grad, **EXACT, msg=name)


def test_the_encoder_backward_by_hand_on_two_rows():
    # x = [[1, 2], [3, -1]], W_enc (2, 3); row 0 keeps feature 2, row 1 keeps features 0 and 1
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    pattern = _sparse.Pattern(torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1]), torch.tensor([0, 1]), 3)
    values = _sparse.gathered((x @ w + b).detach(), x, w, b, pattern)
    assert values.tolist() == [6.5, 3.0, -7.0]  # 1 * 0.5 + 2 * 3; 3 * 1 - 1 * 0; 3 * -2 - 1 * 1
    (values * torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)).sum().backward()
    assert w.grad.tolist() == [[6.0, -3.0, 1.0], [-2.0, 1.0, 2.0]]  # column c: sum of weight * x[row]
    assert x.grad.tolist() == [[0.5, 3.0], [4.0, -1.0]]  # row 0: 1 * W[:, 2]; row 1: 2 * W[:, 0] - W[:, 1]
    assert b.grad.tolist() == [2.0, -1.0, 1.0]


def test_gradcheck_of_the_gathered_pre_activations_and_the_decoder():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    w_dec = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    pattern = _sparse.batch_topk_pattern(x.detach() @ w.detach(), 2)  # rows with 0 .. 7 entries

    def encode(x, w, b):  # pre recomputed from the inputs, so that the finite differences see it move
        return _sparse.gathered((x @ w + b).detach(), x, w, b, pattern)

    assert torch.autograd.gradcheck(encode, (x, w, b))
    values = torch.randn(len(pattern.cols), generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, d: _sparse.decode(v, pattern, d), (values, w_dec))
    assert len(set(torch.bincount(pattern.rows, minlength=5).tolist())) > 1  # bags of several sizes


def steps(monkeypatch, tmp_path, make, sparse, x, **options):
    """Train with the sparse or the dense path; the state of the dictionary and of Adam after every step."""
    states, real = [], train_module._step

    def step(made, state, *args):
        real(made, state, *args)
        adam = {i: {k: v.clone() for k, v in slot.items()} for i, slot in state.optimizer.state_dict()["state"].items()}
        states.append(({k: v.clone() for k, v in made.state_dict().items()}, adam, state.last_fired.clone()))

    with monkeypatch.context() as m:
        m.setattr(train_module, "_step", step)
        if not sparse:
            m.setattr(train_module, "_decodes_sparsely", lambda made: False)
        torch.manual_seed(0)
        made = make()
        train_dictionary(None, x, None, made, out=tmp_path / str(sparse), **options)
    return states


@pytest.mark.parametrize(
    "make",
    [lambda: SAE(8, 64, k=2).double(), lambda: Transcoder(8, 4, 64, activation="batchtopk", k=2, skip=True).double()],
    ids=["topk", "batchtopk-transcoder-skip"],
)
def test_sparse_training_follows_the_dense_training_step_by_step(monkeypatch, tmp_path, make):
    width = 12 if isinstance(make(), Transcoder) else 8
    x = torch.randn(400, width, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    options = {"tokens": 800, "batch_size": 20, "lr": 3e-3, "seed": 1, "progress": False}  # dead after 80 tokens
    dense = steps(monkeypatch, tmp_path, make, False, x, **options)
    sparse = steps(monkeypatch, tmp_path, make, True, x, **options)
    assert len(dense) == len(sparse) == 40
    for i, ((d, d_adam, d_fired), (s, s_adam, s_fired)) in enumerate(zip(dense, sparse, strict=True)):
        for name, value in d.items():
            torch.testing.assert_close(s[name], value, rtol=0, atol=1e-10, msg=f"step {i}: {name}")
        for slot, values in d_adam.items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(s_adam[slot][key], values[key], rtol=0, atol=1e-10, msg=f"step {i}: {key}")
        assert torch.equal(s_fired, d_fired), i
    dead_steps = sum(bool(((i + 1) * 20 - fired >= 80).any()) for i, (_, _, fired) in enumerate(dense))
    assert dead_steps >= 10  # AuxK's loss ran in many of the steps compared
    moved = (dense[-1][0]["W_dec"] - make().W_dec).abs().max()
    assert moved > 1e-2  # trained, not only initialised


def test_a_feature_taken_with_a_non_positive_pre_activation_has_not_fired():
    pre = torch.tensor([[3.0, -1.0, -2.0, -4.0], [-1.0, -5.0, 2.0, -3.0]])  # one positive entry per row, k = 2
    pattern = _sparse.topk_pattern(pre, 2)
    assert sorted(zip(pattern.rows.tolist(), pattern.cols.tolist(), strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 2)]
    values = torch.relu(pre[pattern.rows, pattern.cols])
    assert _sparse.fired(values, pattern).tolist() == [True, False, True, False]
    assert _sparse.fired(values, pattern).tolist() == (_math.topk(pre, 2) > 0).any(0).tolist()
