"""RelP for edges (`edge_attribution(..., rules="relp")`) against the hand-written float64 forward with RelP's rules.

The reference is test_circuit_scores' forward by hand (every reader reads its own copy of the residual stream), run
on a copy of the model whose norms, MLP activations and gated products are surrogates: modules whose value is the
original's and whose gradient is the rule's: ``w * x * detach(1 / rms(x))`` (RMSNorm; in float32 as HF's RMSNorm,
LXT and the rule compute it), ``(x - mean) / detach(std) * w + b`` (LayerNorm), ``act(x) + detach(act(x) / (x +
1e-10)) * (x - detach(x))`` (identity rule), ``down(p / 2 + detach(p / 2))`` (half rule on the gated product). Each
edge's score is then the decomposition of that forward's gradient, as for EAP.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attribution.circuits import edge_attribution
from tests.attribution.circuits.test_circuit_scores import CLEAN, CORRUPTED, hand_scores, llama, metric, reference
from tests.attribution.circuits.test_circuit_scores import tiny_gpt2 as gpt2
from tests.support import hook_state


class _RMSRule(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # Float64RMSNorm's
        scale = torch.rsqrt(x.detach().float().pow(2).mean(-1, keepdim=True) + self.eps)  # in float32, as HF's
        through = self.weight * (x.float() * scale).double()  # backward: float64(float32(w g) * scale)
        return value.detach() + (through - through.detach())


class _LayerNormRule(nn.Module):
    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (x.var(-1, unbiased=False, keepdim=True) + self.norm.eps).sqrt()
        return (x - x.mean(-1, keepdim=True)) / std.detach() * self.norm.weight + self.norm.bias


class _IdentityRule(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(x).detach()
        return y + (y / (x.detach() + 1e-10)) * (x - x.detach())


class _HalfRule(nn.Module):
    def __init__(self, down: nn.Module) -> None:
        super().__init__()
        self.down = down

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return self.down(p / 2 + (p / 2).detach())


def surrogate(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose backward is RelP's (same values)."""
    model = copy.deepcopy(model)
    if hasattr(model, "model"):
        for layer in model.model.layers:
            layer.input_layernorm = _RMSRule(layer.input_layernorm)
            layer.post_attention_layernorm = _RMSRule(layer.post_attention_layernorm)
            layer.mlp.act_fn = _IdentityRule(layer.mlp.act_fn)
            layer.mlp.down_proj = _HalfRule(layer.mlp.down_proj)
        model.model.norm = _RMSRule(model.model.norm)
    else:
        for block in model.transformer.h:
            block.ln_1, block.ln_2 = _LayerNormRule(block.ln_1), _LayerNormRule(block.ln_2)
            block.mlp.act = _IdentityRule(block.mlp.act)
        model.transformer.ln_f = _LayerNormRule(model.transformer.ln_f)
    return model


BUILDS = pytest.mark.parametrize("build", [llama, gpt2], ids=["llama-gqa", "gpt2"])


@BUILDS
def test_the_surrogate_forward_is_the_model(build):
    model = build()
    with torch.no_grad():
        logits, _ = reference(surrogate(model), CLEAN, lambda name, x, w: x)
        torch.testing.assert_close(logits, model(CLEAN).logits, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("ig_steps", [1, 2])
@BUILDS
def test_every_relp_score_is_the_rules_decomposition(build, ig_steps):
    model = build()
    writers, readers, expected = hand_scores(surrogate(model), ig_steps)
    scores = edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=ig_steps, progress=False, rules="relp")
    assert scores.writers == writers and scores.rules == "relp" and scores.ig_steps == ig_steps
    got = scores.scores[:, [scores.readers.index(r) for r in readers]]
    assert torch.equal(got.isnan(), expected.isnan())
    scale = float(expected.nan_to_num().abs().max())
    # the RMSNorm rule computes in float32 (as HF's RMSNorm and LXT): Llama's scores carry float32 rounding (the
    # surrogate rounds each reader's gradient, the run their sum); GPT-2's LayerNorm rule computes in float64
    tolerance = 3e-8 if build is llama else 1e-10
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * scale, equal_nan=True)
    # not vacuous: the rules move the scores far beyond the tolerance on readers of every kind (overall by > 1e-3)
    eap = edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=ig_steps, progress=False)
    moved = (scores.scores - eap.scores).nan_to_num().abs().amax(0)
    for kind in (".q", ".k", ".v", "m0", "m1", "logits"):
        columns = [i for i, r in enumerate(scores.readers) if r.endswith(kind)]
        assert float(moved[columns].max()) > 1e-6 * scale, kind  # 10^4 x the tolerance
    assert float(moved.max()) > 1e-3 * scale


@BUILDS
def test_gradient_rules_are_the_default_bitwise(build):
    model = build()
    default = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False)
    gradient = edge_attribution(model, CLEAN, CORRUPTED, metric, progress=False, rules="gradient")
    assert torch.equal(default.scores.nan_to_num(), gradient.scores.nan_to_num())
    assert default.rules == gradient.rules == "gradient"


def test_a_bad_rules_value_is_refused():
    with pytest.raises(ValueError, match="`rules` must be one of"):
        edge_attribution(gpt2(), CLEAN, CORRUPTED, metric, progress=False, rules="lrp")  # type: ignore[arg-type]


def test_relp_leaves_the_model_as_it_was():
    model = llama()
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)  # a mixed state, to be kept as it is
    hooks, flags = hook_state(model), [p.requires_grad for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        before = model(CLEAN).logits
    edge_attribution(model, CLEAN, CORRUPTED, metric, ig_steps=2, progress=False, rules="relp")
    assert hook_state(model) == hooks and [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters()) and not model.training and torch.is_grad_enabled()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params, strict=True))
    with torch.no_grad():
        assert torch.equal(model(CLEAN).logits, before)
