"""ReLU's L1 and JumpReLU's L0 training: losses and gradients against a slow float64 hand computation of the papers'
formulas, one Adam step, the straight-through estimators, and the settings refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attribution import SAE, Transcoder, train_dictionary
from attribution.dictionaries import _math
from attribution.dictionaries import train as train_module

B, D_IN, D_OUT, N = 6, 3, 2, 5


def plan(dictionary, **penalties):
    """A training plan for ``dictionary`` with ``penalties`` (the other settings do not enter the loss)."""
    settings = {"l1_coefficient": None, "l0_coefficient": None, "bandwidth": None, "sparsity_warmup": None}
    return train_module._Plan(
        kind=type(dictionary).__name__, dictionary=repr(dictionary), rows=B, width=D_IN, steps=10, tokens=10 * B,
        batch_size=B, lr=1e-3, seed=0, dead_after=B, **{**settings, **penalties},
    )  # fmt: skip


def state(dictionary, log_threshold=None):
    parameters = [*dictionary.parameters(), *([log_threshold] if log_threshold is not None else [])]
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    return train_module._State(0, optimizer, torch.zeros(N, dtype=torch.long), log_threshold)


def relu_sae():
    g = torch.Generator().manual_seed(0)
    sae = SAE(D_IN, N, activation="relu").double()
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))  # decoder rows of any norm
    return sae, torch.randn(B, D_IN, generator=g, dtype=torch.float64)


def hand_relu(sae, x, c):
    """The L1-penalised loss and its gradients, element by element (Anthropic's April 2024 update, SAELens)."""
    W_enc, b_enc, W_dec, b_dec = (p.detach().tolist() for p in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
    x = x.tolist()
    norm = [math.sqrt(sum(w * w for w in W_dec[i])) for i in range(N)]
    grads = {k: [[0.0] * len(r) if isinstance(r, list) else 0.0 for r in v] for k, v in
             {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec}.items()}  # fmt: skip
    loss = 0.0
    for b in range(B):
        z = [sum((x[b][j] - b_dec[j]) * W_enc[j][i] for j in range(D_IN)) + b_enc[i] for i in range(N)]
        f = [max(zi, 0.0) for zi in z]
        xh = [sum(f[i] * W_dec[i][j] for i in range(N)) + b_dec[j] for j in range(D_IN)]
        loss += (sum((x[b][j] - xh[j]) ** 2 for j in range(D_IN)) + c * sum(f[i] * norm[i] for i in range(N))) / B
        g_xh = [-2 * (x[b][j] - xh[j]) / B for j in range(D_IN)]
        g_f = [sum(g_xh[j] * W_dec[i][j] for j in range(D_IN)) + c * norm[i] / B for i in range(N)]
        g_z = [g_f[i] * (z[i] > 0) for i in range(N)]
        for i in range(N):
            grads["b_enc"][i] += g_z[i]
            for j in range(D_IN):
                grads["W_dec"][i][j] += g_xh[j] * f[i] + c * f[i] * W_dec[i][j] / norm[i] / B
                grads["W_enc"][j][i] += g_z[i] * (x[b][j] - b_dec[j])
        for j in range(D_IN):
            grads["b_dec"][j] += g_xh[j] - sum(g_z[i] * W_enc[j][i] for i in range(N))
    return loss, {k: torch.tensor(v, dtype=torch.float64) for k, v in grads.items()}


def jumprelu_transcoder():
    g = torch.Generator().manual_seed(1)
    tc = Transcoder(D_IN, D_OUT, N, activation="jumprelu", skip=True).double()
    with torch.no_grad():
        for p in tc.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    log_threshold = (0.3 + 0.4 * torch.rand(N, generator=g, dtype=torch.float64)).log().requires_grad_(True)
    x = torch.randn(B, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(B, D_OUT, generator=g, dtype=torch.float64)
    return tc, log_threshold, x, y


def hand_jumprelu(tc, log_threshold, x, y, c, eps):
    """The L0-penalised loss and its pseudo-gradients (Rajamanoharan et al. 2024, eqs. 9-12), element by element."""
    W_enc, b_enc, W_dec, b_dec, W_skip = (
        p.detach().tolist() for p in (tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, tc.W_skip)
    )
    theta = [math.exp(v) for v in log_threshold.tolist()]
    x, y = x.tolist(), y.tolist()
    zeros = {"W_enc": (D_IN, N), "b_enc": (N,), "W_dec": (N, D_OUT), "b_dec": (D_OUT,), "W_skip": (D_IN, D_OUT),
             "log_threshold": (N,)}  # fmt: skip
    grads = {k: torch.zeros(shape, dtype=torch.float64) for k, shape in zeros.items()}
    loss, near = 0.0, 0
    for b in range(B):
        z = [sum(x[b][j] * W_enc[j][i] for j in range(D_IN)) + b_enc[i] for i in range(N)]
        H = [1.0 if z[i] > theta[i] else 0.0 for i in range(N)]
        K = [1.0 if abs((z[i] - theta[i]) / eps) < 0.5 else 0.0 for i in range(N)]
        near += int(sum(K))
        f = [z[i] * H[i] for i in range(N)]
        yh = [sum(f[i] * W_dec[i][k] for i in range(N)) + b_dec[k] + sum(x[b][j] * W_skip[j][k] for j in range(D_IN))
              for k in range(D_OUT)]  # fmt: skip
        loss += (sum((y[b][k] - yh[k]) ** 2 for k in range(D_OUT)) + c * sum(H)) / B
        g_yh = [-2 * (y[b][k] - yh[k]) / B for k in range(D_OUT)]
        g_f = [sum(g_yh[k] * W_dec[i][k] for k in range(D_OUT)) for i in range(N)]
        for i in range(N):
            g_z = g_f[i] * H[i]  # no straight-through gradient to the pre-activation
            d_theta = g_f[i] * -(theta[i] / eps) * K[i] + (c / B) * -(1 / eps) * K[i]
            grads["log_threshold"][i] += theta[i] * d_theta  # threshold = exp(log_threshold)
            grads["b_enc"][i] += g_z
            for j in range(D_IN):
                grads["W_enc"][j][i] += g_z * x[b][j]
            for k in range(D_OUT):
                grads["W_dec"][i][k] += g_yh[k] * f[i]
        for k in range(D_OUT):
            grads["b_dec"][k] += g_yh[k]
            for j in range(D_IN):
                grads["W_skip"][j][k] += x[b][j] * g_yh[k]
    assert 0 < near < B * N  # some pre-activations within the kernel, some outside
    return loss, grads


def test_relu_loss_and_gradients_equal_the_hand_formula_in_float64():
    sae, x = relu_sae()
    p = plan(sae, l1_coefficient=0.7, sparsity_warmup=4)
    loss = train_module._loss(sae, state(sae), x, x, p, 1, B).loss  # step 1 of a 4-step warm-up: 0.7 * 2 / 4
    loss.backward()
    expected, grads = hand_relu(sae, x, 0.7 * 2 / 4)
    torch.testing.assert_close(loss.item(), expected, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(getattr(sae, name).grad, grad, rtol=1e-12, atol=1e-14, msg=name)
    f = sae.encode(x)
    assert (f > 0).any() and (f == 0).any()  # both sides of the ReLU are exercised


def test_jumprelu_loss_and_pseudo_gradients_equal_the_paper_in_float64():
    tc, log_threshold, x, y = jumprelu_transcoder()
    p = plan(tc, l0_coefficient=0.2, bandwidth=0.5, sparsity_warmup=0)
    loss = train_module._loss(tc, state(tc, log_threshold), x, y, p, 0, B).loss
    loss.backward()
    expected, grads = hand_jumprelu(tc, log_threshold, x, y, 0.2, 0.5)
    torch.testing.assert_close(loss.item(), expected, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        got = log_threshold.grad if name == "log_threshold" else getattr(tc, name).grad
        torch.testing.assert_close(got, grad, rtol=1e-12, atol=1e-14, msg=name)
    assert (log_threshold.grad != 0).any()


def test_one_step_is_adams_first_step_on_those_gradients_with_free_decoder_norms():
    """Adam's first step moves each entry by ``lr * g / (|g| + eps)``; no row is renormalised or projected."""
    sae, x = relu_sae()
    before = {k: v.detach().clone() for k, v in sae.named_parameters()}
    _, grads = hand_relu(sae, x, 0.5)
    s = state(sae)
    train_module._step(sae, s, x, x, plan(sae, l1_coefficient=0.5, sparsity_warmup=0), 0, B)
    for name, g in grads.items():
        torch.testing.assert_close(getattr(sae, name).detach(), before[name] - 1e-3 * g / (g.abs() + 1e-8), msg=name)
    assert not torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(N, dtype=torch.float64))

    tc, log_threshold, x, y = jumprelu_transcoder()
    start = log_threshold.detach().clone()
    _, grads = hand_jumprelu(tc, log_threshold, x, y, 0.2, 0.5)
    s = state(tc, log_threshold)
    train_module._step(tc, s, x, y, plan(tc, l0_coefficient=0.2, bandwidth=0.5, sparsity_warmup=0), 0, B)
    g = grads["log_threshold"]
    torch.testing.assert_close(log_threshold.detach(), start - 1e-3 * g / (g.abs() + 1e-8))
    assert torch.equal(tc.threshold, log_threshold.detach().exp())  # the buffer encode uses follows the parameter


def test_the_straight_through_estimators_against_their_formulas():
    g = torch.Generator().manual_seed(2)
    pre = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    threshold = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    out = _math.jumprelu_ste(pre, threshold, 0.4)
    assert torch.equal(out, _math.jumprelu(pre, threshold))
    d_pre, d_threshold = torch.autograd.grad(out, (pre, threshold), upstream)
    kernel = ((pre - threshold) / 0.4).abs() < 0.5
    assert torch.equal(d_pre, upstream * (pre > threshold))
    torch.testing.assert_close(d_threshold, (-(threshold / 0.4) * kernel * upstream).sum((0, 1)), rtol=1e-14, atol=0)
    step = _math.step_ste(pre, threshold, 0.4)
    assert torch.equal(step, (pre > threshold).double())
    (d_threshold,) = torch.autograd.grad(step, threshold, upstream)
    torch.testing.assert_close(d_threshold, (-(1 / 0.4) * kernel * upstream).sum((0, 1)), rtol=1e-14, atol=0)
    step = _math.step_ste(pre, threshold, 0.4)
    assert torch.equal(torch.autograd.grad(step.sum(), pre, materialize_grads=True)[0], torch.zeros_like(pre))


def test_penalty_settings_are_checked_by_name(tmp_path):
    x = torch.randn(16, 4)

    def train(dictionary, **options):
        return train_dictionary(None, x, None, dictionary, out=tmp_path / "x", progress=False, **options)

    with pytest.raises(ValueError, match=r"activation='relu' trains with an L1 penalty .* give `l1_coefficient`"):
        train(SAE(4, 8, activation="relu"))
    with pytest.raises(ValueError, match=r"activation='jumprelu' trains with an L0 penalty .* give `l0_coefficient`"):
        train(SAE(4, 8, activation="jumprelu"))
    with pytest.raises(ValueError, match=r"`l1_coefficient` is a setting of activation='relu'; this SAE has acti"):
        train(SAE(4, 8, activation="jumprelu"), l0_coefficient=1.0, l1_coefficient=1.0)
    with pytest.raises(ValueError, match=r"`bandwidth` is a setting of activation='jumprelu'; this Transcoder has"):
        train(Transcoder(2, 2, 8, activation="relu"), l1_coefficient=1.0, bandwidth=0.1)
    with pytest.raises(ValueError, match=r"`sparsity_warmup` warms up .*='topk', whose sparsity is set by k"):
        train(SAE(4, 8, k=2), sparsity_warmup=10)
    with pytest.raises(ValueError, match=r"`bandwidth` must be positive; got 0"):
        train(SAE(4, 8, activation="jumprelu"), l0_coefficient=1.0, bandwidth=0)
    with pytest.raises(ValueError, match=r"`l1_coefficient` must be a non-negative number; got nan"):
        train(SAE(4, 8, activation="relu"), l1_coefficient=float("nan"))


def test_settings_are_stored_and_a_run_written_before_them_still_resumes(tmp_path):
    x = torch.randn(40, 4)
    train_dictionary(None, x, None, SAE(4, 8, activation="jumprelu"), out=tmp_path / "j", batch_size=10,
                     l0_coefficient=0.5, progress=False)  # fmt: skip
    stored = json.loads((tmp_path / "j" / "training.json").read_text())
    assert (stored["l0_coefficient"], stored["bandwidth"], stored["sparsity_warmup"]) == (0.5, 0.05, 0)
    with pytest.raises(ValueError, match=r"other settings \(l0_coefficient: 0\.5 there, 0\.25 now\)"):
        train_dictionary(None, x, None, SAE(4, 8, activation="jumprelu"), out=tmp_path / "j", batch_size=10,
                         l0_coefficient=0.25, progress=False)  # fmt: skip
    torch.manual_seed(0)
    done = train_dictionary(None, x, None, SAE(4, 8, k=2), out=tmp_path / "t", batch_size=10, progress=False)
    settings = tmp_path / "t" / "training.json"
    new = ("l1_coefficient", "l0_coefficient", "bandwidth", "sparsity_warmup")
    old = {k: v for k, v in json.loads(settings.read_text()).items() if k not in new}
    settings.write_text(json.dumps(old))  # as written before the penalties existed
    torch.manual_seed(1)
    again = train_dictionary(None, x, None, SAE(4, 8, k=2), out=tmp_path / "t", batch_size=10, progress=False)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in done.state_dict().items())


def test_a_fresh_jumprelu_threshold_starts_at_one_hundredth_and_a_given_one_is_kept(tmp_path):
    x = torch.randn(8, 4)
    fresh = SAE(4, 6, activation="jumprelu")
    given = SAE(4, 6, activation="jumprelu")
    with torch.no_grad():
        given.threshold.copy_(torch.tensor([0.5, 0.0, 1.0, 2.0, -1.0, 0.3]))
    plan_ = train_module._planned(fresh, train_module.open_source(x), None, 8, 1e-3, 0,
                                  {"l1_coefficient": None, "l0_coefficient": 1.0, "bandwidth": 0.1,
                                   "sparsity_warmup": 0})  # fmt: skip
    start = train_module._resume(tmp_path / "a", plan_, fresh).log_threshold.exp()
    torch.testing.assert_close(start, torch.full((6,), 0.01))
    start = train_module._resume(tmp_path / "b", plan_, given).log_threshold.exp()
    torch.testing.assert_close(start, torch.tensor([0.5, 0.01, 1.0, 2.0, 0.01, 0.3]))
