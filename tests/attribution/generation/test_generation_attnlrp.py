"""``attribute_generation(..., method="attnlrp")``: AttnLRP's rules on the batched backward passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import attribute_generation
from attribution.lrp import AttnLRP
from tests.attribution.models import lm64

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    return lm64("llama")


def _gpt2() -> nn.Module:
    return lm64("gpt2")


@pytest.mark.parametrize("make", [_llama, _gpt2])
@pytest.mark.parametrize("target_batch", [1, 3, 8])
def test_equals_attnlrp_called_per_generated_step(make: object, target_batch: int) -> None:
    model = make()  # type: ignore[operator]
    prompts, generated = torch.tensor([[1, 5, 7], [3, 3, 30]]), torch.tensor([[9, 2, 11, 4], [0, 39, 2, 2]])
    result = attribute_generation(model, prompts, generated=generated, method="attnlrp", target_batch=target_batch)
    assert result.scores.shape == (2, 4, 7) and result.method == "attnlrp"
    for b in range(2):
        ids = torch.cat([prompts[b], generated[b]])
        for i in range(4):
            expected = AttnLRP(model)(ids[None, : 3 + i], target=int(generated[b, i]))[0]
            torch.testing.assert_close(result.scores[b, i, : 3 + i], expected, rtol=1e-12, atol=1e-14)
            assert bool(result.scores[b, i, 3 + i :].eq(0).all())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_per_dimension_and_not_the_plain_gradient() -> None:
    model, prompt, generated = _llama(), torch.tensor([1, 5, 7]), torch.tensor([9, 2, 11])
    result = attribute_generation(model, prompt, generated=generated, method="attnlrp", per_dimension=True)
    assert result.per_dimension is not None and result.per_dimension.shape == (3, 6, 16)
    torch.testing.assert_close(result.per_dimension.sum(-1), result.scores, rtol=1e-12, atol=1e-14)
    plain = attribute_generation(model, prompt, generated=generated, method="input_x_gradient")
    assert (plain.scores - result.scores).abs().max() > 1e-3 * plain.scores.abs().max()


def test_an_unknown_layout_is_named_and_the_model_left_clean() -> None:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=4)  # fmt: skip
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"query_key_value.* fuses query, key and value per head"):
        attribute_generation(model, torch.tensor([1, 2]), generated=torch.tensor([3]), method="attnlrp")
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert all(p.requires_grad for p in model.parameters())
