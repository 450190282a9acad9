"""RelP (`attribution_patching(..., rules="relp")`) against a hand-written float64 forward with the rules as surrogates.

The reference re-implements the tiny models' forward by hand (their linear layers, embeddings and rotary tables are
used as functions) with each rule written as a surrogate whose value is the forward's and whose gradient is the rule's:
``x * detach(1 / rms(x)) * w`` (RMSNorm), ``(x - mean) / detach(std) * w + b`` (LayerNorm), ``x * detach(act(x) / x)``
(identity rule), ``p / 2 + detach(p / 2)`` (half rule on the gated product). RelP's estimate of a cell is then
``metric(corrupted) + sum over the cell of (a_clean - a_corrupted) . g`` with ``g`` the gradient of that forward. The
same reference without the surrogates must give plain attribution patching, which checks the reference itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attribution import attribution_patching

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from tests.attribution.models import lm64  # noqa: E402

Site = tuple[str, int]  # (family, layer): "resid" (block output), "attn", "mlp", "norm" (the MLP's norm) outputs,
# "heads" (o_proj input). At "norm" the site is the output of a module with a rule: the rule must act before the tap.
HEADS = 4


def _llama() -> nn.Module:
    return lm64("llama")


def _gpt2() -> nn.Module:
    return lm64("gpt2")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, 40, (3, 7), generator=generator), torch.randint(0, 40, (3, 7), generator=generator)


def _metric(output: Any) -> torch.Tensor:
    """(batch,) logit of token 3 minus that of token 5 at the last position (asymmetric in the vocabulary)."""
    logits = getattr(output, "logits", output)
    return logits[:, -1, 3] - logits[:, -1, 5]


def _summed(output: Any) -> torch.Tensor:
    return _metric(output).sum()


# -- the reference: a hand-written forward, with or without the rules' surrogates --------------------------------
class _Sites:
    """Records each site's activation and makes the gradient at it available (or replaces it, for IG points)."""

    def __init__(self, replace: dict[Site, torch.Tensor] | None = None) -> None:
        self.replace = replace or {}
        self.acts: dict[Site, torch.Tensor] = {}
        self.leaves: dict[Site, torch.Tensor] = {}

    def __call__(self, site: Site, x: torch.Tensor) -> torch.Tensor:
        if site in self.replace:
            leaf = self.replace[site].detach().clone().requires_grad_(True)
            self.acts[site], self.leaves[site] = leaf.detach(), leaf
            return leaf
        self.acts[site] = x.detach()
        self.leaves[site] = torch.zeros_like(x, requires_grad=True)
        return x + self.leaves[site]  # the gradient at x, through everything after it


def _constant(x: torch.Tensor, rules: bool) -> torch.Tensor:
    return x.detach() if rules else x


def _rms(norm: nn.Module, x: torch.Tensor, rules: bool) -> torch.Tensor:
    return x * _constant(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon), rules) * norm.weight


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor, rules: bool) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    std = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    return centred / _constant(std, rules) * norm.weight + norm.bias


def _act(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rules: bool) -> torch.Tensor:
    return x * (fn(x) / x).detach() if rules else fn(x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, d) each -> (batch, tokens, heads * d): causal softmax attention, by its gradient."""
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    z = scores.softmax(-1) @ v
    return z.transpose(1, 2).reshape(q.shape[0], t, -1)


def _llama_forward(model: nn.Module, ids: torch.Tensor, sites: _Sites, rules: bool) -> torch.Tensor:
    b, t = ids.shape
    h = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(h, torch.arange(t)[None])
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms(layer.input_layernorm, h, rules)
        q, k, v = (p(x).view(b, t, -1, attn.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        group = q.shape[1] // k.shape[1]
        z = sites(("heads", i), _attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        h = h + sites(("attn", i), attn.o_proj(z))
        x = sites(("norm", i), _rms(layer.post_attention_layernorm, h, rules))
        product = _act(F.silu, mlp.gate_proj(x), rules) * mlp.up_proj(x)
        if rules:  # the half rule
            product = product / 2 + (product / 2).detach()
        h = h + sites(("mlp", i), mlp.down_proj(product))
        h = sites(("resid", i), h)
    return model.lm_head(_rms(model.model.norm, h, rules))


def _gpt2_forward(model: nn.Module, ids: torch.Tensor, sites: _Sites, rules: bool) -> torch.Tensor:
    b, t = ids.shape
    body = model.transformer
    h = body.wte(ids) + body.wpe(torch.arange(t))
    for i, block in enumerate(body.h):
        x = _layer_norm(block.ln_1, h, rules)
        q, k, v = (p.view(b, t, HEADS, -1).transpose(1, 2) for p in block.attn.c_attn(x).split(x.shape[-1], -1))
        z = sites(("heads", i), _attention(q, k, v))
        h = h + sites(("attn", i), block.attn.c_proj(z))
        x = sites(("norm", i), _layer_norm(block.ln_2, h, rules))
        h = h + sites(("mlp", i), block.mlp.c_proj(_act(block.mlp.act, block.mlp.c_fc(x), rules)))
        h = sites(("resid", i), h)
    return model.lm_head(_layer_norm(body.ln_f, h, rules))


FORWARDS = {"llama": _llama_forward, "gpt2": _gpt2_forward}
MODELS = {"llama": _llama, "gpt2": _gpt2}
NAMES = {
    "llama": {"resid": "model.layers.{}", "attn": "model.layers.{}.self_attn", "mlp": "model.layers.{}.mlp",
              "heads": "model.layers.{}.self_attn.o_proj", "norm": "model.layers.{}.post_attention_layernorm"},
    "gpt2": {"resid": "transformer.h.{}", "attn": "transformer.h.{}.attn", "mlp": "transformer.h.{}.mlp",
             "heads": "transformer.h.{}.attn.c_proj", "norm": "transformer.h.{}.ln_2"},
}  # fmt: skip
OPTIONS: dict[str, dict[str, Any]] = {"resid": {}, "attn": {"element": 0}, "mlp": {}, "heads": {"site": "input"},
                                      "norm": {}}  # fmt: skip


def _reference(kind: str, model: nn.Module, ids: torch.Tensor, rules: bool, replace: dict | None = None) -> _Sites:
    """The hand forward on ``ids``: each site's activation and (in ``.grads``) the summed metric's gradient there."""
    sites = _Sites(replace)
    with torch.enable_grad():
        value = _summed(FORWARDS[kind](model, ids, sites, rules))
        keys = list(sites.leaves)
        grads = torch.autograd.grad(value, [sites.leaves[k] for k in keys], allow_unused=True)
    sites.grads = dict(zip(keys, grads, strict=True))  # type: ignore[attr-defined]
    sites.value = value.detach()  # type: ignore[attr-defined]
    return sites


def _expected(kind: str, family: str, rules: bool, *, heads: bool = False) -> torch.Tensor:
    """(layers, positions[, heads]): the corrupted run's metric plus the first-order effect of each cell."""
    model, (clean, corrupted) = MODELS[kind](), _inputs()
    source, target = _reference(kind, model, clean, rules), _reference(kind, model, corrupted, rules)
    rows = []
    for layer in range(2):
        site = (family, layer)
        product = (source.acts[site] - target.acts[site]) * target.grads[site]  # type: ignore[attr-defined]
        if heads:
            rows.append(product.unflatten(-1, (HEADS, -1)).sum((0, -1)))
        else:
            rows.append(product.sum((0, -1)))
    return (target.value + torch.stack(rows)).float()  # type: ignore[attr-defined]


def _estimate(kind: str, family: str, rules: str, **options: Any) -> torch.Tensor:
    model, (clean, corrupted) = MODELS[kind](), _inputs()
    names = [NAMES[kind][family].format(i) for i in range(2)]
    return attribution_patching(
        model, clean, corrupted, names, _summed, rules=rules, progress=False, **OPTIONS[family], **options
    )


# -- known answers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MODELS))
def test_reference_forward_is_the_model(kind: str) -> None:
    """The hand forward computes the model's logits (with the surrogates too: they change no value)."""
    model, (clean, _) = MODELS[kind](), _inputs()
    with torch.no_grad():
        logits = model(clean).logits
        for rules in (False, True):
            torch.testing.assert_close(FORWARDS[kind](model, clean, _Sites(), rules), logits)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("family", ["resid", "attn", "mlp", "norm"])
def test_relp_matches_the_hand_written_rules(kind: str, family: str) -> None:
    got = _estimate(kind, family, "relp")
    torch.testing.assert_close(got, _expected(kind, family, rules=True))
    # not vacuous: the rules move the estimate (against plain AtP) far beyond the tolerance
    assert (got - _estimate(kind, family, "gradient")).abs().max() > 1e-3


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("family", ["resid", "attn", "mlp", "norm"])
def test_reference_without_rules_is_attribution_patching(kind: str, family: str) -> None:
    torch.testing.assert_close(_estimate(kind, family, "gradient"), _expected(kind, family, rules=False))


@pytest.mark.parametrize("kind", list(MODELS))
def test_relp_per_head(kind: str) -> None:
    """Heads side by side at the attention's output projection input, (layers, positions, heads)."""
    got = _estimate(kind, "heads", "relp", heads=HEADS)
    assert got.shape == (2, 7, HEADS)
    torch.testing.assert_close(got, _expected(kind, "heads", rules=True, heads=True))


def test_relp_per_example_and_positions() -> None:
    """Chosen positions, one value per batch item: each item's cells against the reference's."""
    model, (clean, corrupted) = _llama(), _inputs()
    names = [f"model.layers.{i}.mlp" for i in range(2)]
    got = attribution_patching(
        model, clean, corrupted, names, _metric, rules="relp", positions=[6, 2], per_example=True, progress=False
    )
    source, target = _reference("llama", model, clean, True), _reference("llama", model, corrupted, True)
    with torch.no_grad():
        base = _metric(model(corrupted))
    want = torch.stack([
        ((source.acts[("mlp", i)] - target.acts[("mlp", i)]) * target.grads[("mlp", i)])[:, [6, 2]].sum(-1).T + base
        for i in range(2)
    ])  # fmt: skip
    torch.testing.assert_close(got, want.float())


def test_relp_with_integrated_steps() -> None:
    """``ig_steps=2``: the rules' gradient averaged at the target's activation and at the midpoint to the source's."""
    model, (clean, corrupted) = _gpt2(), _inputs()
    got = attribution_patching(
        model, clean, corrupted, "transformer.h.0.mlp", _summed, rules="relp", ig_steps=2, progress=False
    )
    site = ("mlp", 0)
    source, target = _reference("gpt2", model, clean, True), _reference("gpt2", model, corrupted, True)
    a_s, a_t = source.acts[site], target.acts[site]
    middle = _reference("gpt2", model, corrupted, True, replace={site: a_t + 0.5 * (a_s - a_t)})
    grad = (target.grads[site] + middle.grads[site]) / 2  # type: ignore[attr-defined]
    want = target.value + ((a_s - a_t) * grad).sum((0, -1))  # type: ignore[attr-defined]
    torch.testing.assert_close(got, want[None].float())


# -- the contract -------------------------------------------------------------------------------------------------
def _state(model: nn.Module) -> list[Any]:
    return [
        model.training,
        [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()],
        [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks)) for n, m in
         model.named_modules()],
    ]  # fmt: skip


def _outputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = _summed(model(ids))
    grads = torch.autograd.grad(out, list(model.parameters()))
    return out.detach(), list(grads)


@pytest.mark.parametrize("kind", list(MODELS))
def test_gradient_rules_are_the_default_bitwise(kind: str) -> None:
    model, (clean, corrupted) = MODELS[kind](), _inputs()
    names = NAMES[kind]["resid"].format(0)
    default = attribution_patching(model, clean, corrupted, names, _summed, progress=False)
    assert torch.equal(attribution_patching(model, clean, corrupted, names, _summed, rules="gradient",
                                            progress=False), default)  # fmt: skip


@pytest.mark.parametrize("fail", [False, True])
def test_model_left_unchanged(fail: bool) -> None:
    """Outputs and parameter gradients bitwise equal, no hook left, same state: after a call and after an error."""
    model, (clean, corrupted) = _llama(), _inputs()
    before_state, (before_out, before_grads) = _state(model), _outputs(model, clean)
    calls = []

    def metric(output: Any) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        if fail and torch.is_grad_enabled():  # raises in the gradient run, with the rules' hooks in place
            raise RuntimeError("metric failed")
        return _summed(output)

    if fail:
        with pytest.raises(RuntimeError, match="metric failed"):
            attribution_patching(model, clean, corrupted, "model.layers.*.mlp", metric, rules="relp", progress=False)
    else:
        attribution_patching(model, clean, corrupted, "model.layers.*.mlp", metric, rules="relp", progress=False)
    assert calls[-1] is True
    after_out, after_grads = _outputs(model, clean)
    assert torch.equal(after_out, before_out)
    assert all(torch.equal(a, b) for a, b in zip(after_grads, before_grads, strict=True))
    assert _state(model) == before_state


@pytest.mark.parametrize("bad", ["lrp", "RelP", None, 1])
def test_bad_rules_value(bad: Any) -> None:
    model, (clean, corrupted) = _llama(), _inputs()
    with pytest.raises(ValueError, match=r"`rules` must be one of \['gradient', 'relp'\]"):
        attribution_patching(model, clean, corrupted, "model.layers.0", _summed, rules=bad, progress=False)


def test_relp_refuses_a_model_without_attention() -> None:
    """A model with an embedding but no attention that the rules know: a ValueError naming what was looked for."""

    class Embedder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = nn.Embedding(10, 4), nn.Linear(4, 2)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(ids))

    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"`rules='relp'`.*In Embedder: could not find the decoder layers"):
        attribution_patching(Embedder(), ids, ids + 1, ["out"], lambda out: out.sum(), rules="relp", progress=False)


def test_relp_refuses_a_model_without_its_sites() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"`rules='relp'` needs a HuggingFace decoder.*get_input_embeddings"):
        attribution_patching(model, x, y, ["0"], lambda out: out.sum(), rules="relp", progress=False)
    assert attribution_patching(model, x, y, ["0"], lambda out: out.sum(), progress=False).shape == (1, 4)
