"""The LN-rule reads an RMSNorm's gain from the module: ``weight`` (Llama) or ``1 + weight`` (Gemma), else an error.

Gemma's RMSNorm multiplies by ``1 + weight``; a rule that multiplied by ``weight`` would give Gemma relevance near 0
(its weights start at 0) without a word.
"""

from __future__ import annotations

import pytest
import torch

from attribution._transformer_rules import norm_rule
from attribution.models import rms_norm_gain

transformers = pytest.importorskip("transformers")


def _norm(kind: str) -> torch.nn.Module:
    module = {
        "llama": transformers.models.llama.modeling_llama.LlamaRMSNorm,
        "gemma": transformers.models.gemma.modeling_gemma.GemmaRMSNorm,
    }[kind](6, eps=1e-6).double()
    with torch.no_grad():
        module.weight.copy_(torch.tensor([0.5, -1.25, 2.0, 0.0, 3.5, -0.75], dtype=torch.float64))
    return module


@pytest.mark.parametrize(("kind", "offset"), [("llama", 0.0), ("gemma", 1.0)])
def test_the_gain_is_the_one_the_module_multiplies_by(kind, offset):
    norm = _norm(kind)
    gain = rms_norm_gain(norm, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(gain, norm.weight.detach() + offset, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_the_rule_is_the_backward_with_the_scale_held_constant(kind):
    norm = _norm(kind)
    x = torch.tensor([[0.3, -1.2, 2.5, 0.7, -0.1, 1.9], [-2.0, 0.4, 0.0, 1.1, 3.3, -0.6]], dtype=torch.float64)
    g = torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.5, 0.25], [0.75, 1.25, -3.0, 0.5, 2.0, -1.0]], dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # a constant: no gradient through it
    surrogate = leaf * scale * (norm.weight.detach() + (1.0 if kind == "gemma" else 0.0))
    (expected,) = torch.autograd.grad(surrogate, leaf, g)
    # the rule computes in float32, as HuggingFace's RMSNorm forward (and LXT) do
    torch.testing.assert_close(norm_rule(norm, x)(g), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


def test_an_rms_norm_of_another_convention_is_refused():
    class Doubled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.full((4,), 0.5)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (2 + self.weight)

    with pytest.raises(ValueError, match="neither its `weight` nor `1 \\+ weight`"):
        norm_rule(Doubled(), torch.randn(2, 4))
