"""AttnLRP on tiny random HuggingFace decoders: LXT 2.1 parity (in a subprocess), the rules, the contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from attribution._transformer_rules import identity_rule, layer_norm_rule, rms_norm_rule
from attribution.lrp import AttnLRP
from tests.attribution.models import lm64

transformers = pytest.importorskip("transformers")
HERE = Path(__file__).resolve().parent


def _llama() -> nn.Module:
    return lm64("llama")


def _qwen2() -> nn.Module:
    return lm64("qwen2")


def _gpt2() -> nn.Module:
    return lm64("gpt2")


def _mistral() -> nn.Module:
    torch.manual_seed(3)
    config = transformers.MistralConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return transformers.MistralForCausalLM(config).double().eval()


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}
"""Models LXT 2.1 supports (parity); Mistral is the Llama layout, which LXT does not list."""


def _ids() -> torch.Tensor:
    return torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(5))


@pytest.mark.peers
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
def test_matches_lxt(kind: str, tmp_path: Path) -> None:
    """LXT patches transformers' classes for the whole process: it runs in a subprocess on the saved model."""
    pytest.importorskip("lxt")
    model, ids, targets = MODELS[kind](), _ids(), torch.tensor([5, 11])
    got = AttnLRP(model)(ids, target=targets, reduce=False)
    torch.save({"model": model, "ids": ids, "targets": targets, "position": -1}, tmp_path / "case.pt")
    subprocess.run(
        [sys.executable, str(HERE / "_lxt_reference.py"), kind, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        check=True,
        capture_output=True,
    )
    expected = torch.load(tmp_path / "out.pt")["relevance"]
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", [*MODELS, "mistral"])
def test_the_rules_change_the_gradient_and_conservation_is_reported(kind: str) -> None:
    model, ids = {**MODELS, "mistral": _mistral}[kind](), _ids()
    result = AttnLRP(model).attribute(ids, target=[5, 11])
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits[:, -1]
    torch.testing.assert_close(result.logits, logits[[0, 1], [5, 11]].detach(), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(logits[[0, 1], [5, 11]].sum(), embeds)
    assert not torch.allclose(result.relevance, (embeds * grad).sum(-1))  # plain gradient x input differs
    torch.testing.assert_close(result.conservation, result.relevance.sum(1) / result.logits)
    assert result.relevance.shape == (2, 7)
    assert bool(torch.isfinite(result.conservation).all())


# -- the rules against their formulas, with autograd --------------------------------------------------------------
def test_identity_rule_gives_each_activation_its_output_as_relevance() -> None:
    x = torch.tensor([[1.5, -0.5, 2.0]], dtype=torch.float64)
    y = nn.functional.silu(x)
    relevance_out = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64)  # as a gradient: R / y
    grad_in = identity_rule(x, y)(relevance_out / y)
    torch.testing.assert_close(grad_in * x, relevance_out, rtol=1e-9, atol=1e-12)


def test_rms_norm_rule_is_the_gradient_with_the_scale_held_constant() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.1, -1.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)
    scale = torch.rsqrt(x.detach().float().pow(2).mean(-1, keepdim=True) + 1e-6)
    (expected,) = torch.autograd.grad((weight * (x.float() * scale).double()).sum(), x)
    torch.testing.assert_close(rms_norm_rule(x.detach(), weight, 1e-6)(torch.ones(2, 3, dtype=torch.float64)), expected)


def test_layer_norm_rule_holds_only_the_std_constant() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([0.5, 2.0, -1.0, 1.0], dtype=torch.float64)
    g = torch.tensor([[1.0, 0.0, -2.0, 0.5]], dtype=torch.float64)
    std = (x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    (expected,) = torch.autograd.grad((((x - x.mean(-1, keepdim=True)) / std * weight) * g).sum(), x)
    torch.testing.assert_close(layer_norm_rule(x.detach(), weight, 1e-5)(g), expected)


# -- the contract ----------------------------------------------------------------------------------------------
def test_targets_positions_and_shapes() -> None:
    model, ids = _llama(), _ids()
    lrp = AttnLRP(model)
    predicted = model(ids).logits[:, 3].argmax(-1)
    torch.testing.assert_close(lrp(ids, position=3), lrp(ids, target=predicted, position=3), rtol=0, atol=0)
    difference = lrp(ids, target=lambda logits: logits[:, 5] - logits[:, 6])
    # linear in the seed, up to float32 rounding: RMSNorm's backward runs in float32, as HuggingFace's forward does
    torch.testing.assert_close(difference, lrp(ids, target=5) - lrp(ids, target=6), rtol=1e-5, atol=1e-8)
    assert lrp(ids, target=2, reduce=False).shape == (2, 7, 16)
    mask = torch.ones_like(ids)
    torch.testing.assert_close(lrp({"input_ids": ids, "attention_mask": mask}, target=2), lrp(ids, target=2))


def test_the_model_is_left_as_it_was_found() -> None:
    model, ids = _llama(), _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(ids).logits.detach()
    AttnLRP(model)(ids)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(model(ids).logits.detach(), expected)
    assert not model.training


def test_bad_inputs_are_refused() -> None:
    model = _llama()
    with pytest.raises(TypeError, match="`input_ids` must be integer token ids"):
        AttnLRP(model)(torch.randn(2, 7))
    with pytest.raises(IndexError, match="`position`=9"):
        AttnLRP(model)(_ids(), position=9)
    with pytest.raises(ValueError, match="out of range"):
        AttnLRP(model)(_ids(), target=40)
    with pytest.raises(TypeError, match="get_input_embeddings"):
        AttnLRP(nn.Linear(2, 2))


def test_upsample_is_for_vits() -> None:
    with pytest.raises(ValueError, match="`upsample` is for Vision Transformers"):
        AttnLRP(_gpt2())(_ids(), upsample=True)
