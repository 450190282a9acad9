"""attribute_generation: hand-computed references, captum parity token by token, cost, bad input, state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attribution import attribute_generation
from tests.attribution.models import tiny_llama
from tests.support import hook_state

PROMPT = torch.tensor([3, 17, 5, 42, 8, 29])
GENERATED = torch.tensor([11, 2, 40, 7, 33, 19, 4])


def llama() -> nn.Module:
    return tiny_llama(num_hidden_layers=2).double()


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval().double()


def reference(model: nn.Module, prompt: torch.Tensor, generated: torch.Tensor, method: str) -> torch.Tensor:
    """Slowly, one target at a time: the prefix's embeddings as a leaf, the last position's log-probability."""
    P, N = len(prompt), len(generated)
    ids = torch.cat([prompt, generated])
    rows = torch.zeros(N, P + N, dtype=torch.float64)
    for i in range(N):
        x = model.get_input_embeddings()(ids[None, : P + i]).detach().requires_grad_()
        log_probs = model(inputs_embeds=x).logits[0, -1].log_softmax(-1)
        (grad,) = torch.autograd.grad(log_probs[generated[i]], x)
        rows[i, : P + i] = (grad if method == "saliency" else grad * x)[0].sum(-1)
    return rows


@pytest.mark.parametrize("method", ["saliency", "input_x_gradient"])
@pytest.mark.parametrize("build", [llama, gpt2])
def test_gradient_methods_equal_a_slow_reference(method, build):
    model = build()
    result = attribute_generation(model, PROMPT, generated=GENERATED, method=method, target_batch=3)
    assert result.scores.shape == (7, 13) and result.prompt_len == 6 and result.method == method
    assert torch.equal(result.tokens, torch.cat([PROMPT, GENERATED])) and torch.equal(result.generated, GENERATED)
    torch.testing.assert_close(result.scores, reference(model, PROMPT, GENERATED, method), rtol=1e-9, atol=1e-12)


def test_integrated_gradients_equal_a_slow_reference():
    import numpy as np

    model = llama()
    steps, baseline_token = 6, 9
    result = attribute_generation(model, PROMPT, generated=GENERATED[:4], method="integrated_gradients",
                                  steps=steps, baseline_token=baseline_token, target_batch=3)  # fmt: skip
    points, weights = np.polynomial.legendre.leggauss(steps)
    embed = model.get_input_embeddings()
    P = len(PROMPT)
    for i in range(4):
        ids = torch.cat([PROMPT, GENERATED[:i]])[None]
        base_ids = ids.clone()
        base_ids[0, :P] = baseline_token
        x, base = embed(ids).detach(), embed(base_ids).detach()
        total = torch.zeros_like(x)
        for point, weight in zip(points, weights, strict=True):
            z = (base + 0.5 * (point + 1) * (x - base)).requires_grad_()
            log_prob = model(inputs_embeds=z).logits[0, -1].log_softmax(-1)[GENERATED[i]]
            total += 0.5 * weight * torch.autograd.grad(log_prob, z)[0]
        expected = (total * (x - base))[0].sum(-1)
        torch.testing.assert_close(result.scores[i, : P + i], expected, rtol=1e-9, atol=1e-12)
        assert result.scores[i, P:].eq(0).all()  # generated tokens are held at their embeddings


@pytest.mark.parametrize("method", ["saliency", "input_x_gradient", "integrated_gradients"])
def test_results_do_not_depend_on_target_batch(method):
    model = llama()
    results = [attribute_generation(model, PROMPT, generated=GENERATED, method=method, target_batch=b, steps=5)
               for b in (1, 3, 7, 20)]  # fmt: skip
    for other in results[1:]:
        torch.testing.assert_close(other.scores, results[0].scores, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(("method", "target_batch"), [("input_x_gradient", 3), ("saliency", 7), ("saliency", 2)])
def test_cost_one_forward_and_ceil_n_over_target_batch_backward_passes(method, target_batch, monkeypatch):
    model = llama()
    grad_calls, batches = [], []
    original = torch.autograd.grad

    def counting(*args, **kwargs):
        grad_calls.append(kwargs.get("is_grads_batched", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    handle = model.register_forward_pre_hook(lambda m, a, k: batches.append(k["input_ids"].shape[0]),
                                             with_kwargs=True)  # fmt: skip
    attribute_generation(model, PROMPT, generated=GENERATED, method=method, target_batch=target_batch)
    handle.remove()
    assert len(grad_calls) == math.ceil(len(GENERATED) / target_batch) and all(grad_calls)
    assert batches == [1]


def test_integrated_gradients_forwards_stay_within_target_batch(monkeypatch):
    model = llama()
    batches = []
    handle = model.register_forward_pre_hook(lambda m, a, k: batches.append(k["input_ids"].shape[0]),
                                             with_kwargs=True)  # fmt: skip
    attribute_generation(model, PROMPT, generated=GENERATED, method="integrated_gradients", steps=10, target_batch=4)
    handle.remove()
    assert batches == [4, 4, 2]


def test_rows_are_zero_from_their_own_position_on_and_per_dimension_sums_to_scores():
    model = llama()
    result = attribute_generation(model, PROMPT, generated=GENERATED, per_dimension=True)
    assert result.per_dimension is not None and result.per_dimension.shape == (7, 13, 32)
    torch.testing.assert_close(result.per_dimension.sum(-1), result.scores, rtol=0, atol=0)
    for i in range(7):
        assert result.scores[i, 6 + i :].eq(0).all() and result.scores[i, : 6 + i].ne(0).all()


def test_several_prompts_add_a_leading_axis_and_equal_one_at_a_time():
    model = llama()
    prompts = torch.stack([PROMPT, PROMPT.flip(0)])
    both = attribute_generation(model, prompts, generated=GENERATED[:3])
    assert both.scores.shape == (2, 3, 9) and both.tokens.shape == (2, 9)
    for b in range(2):
        one = attribute_generation(model, prompts[b : b + 1], generated=GENERATED[:3])
        assert one.scores.shape == (3, 9)
        torch.testing.assert_close(both.scores[b], one.scores, rtol=0, atol=1e-13)


def test_greedy_generation_matches_generate():
    model = llama()
    result = attribute_generation(model, PROMPT, max_new_tokens=5)
    expected = model.generate(PROMPT[None], max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 6:]
    assert torch.equal(result.generated, expected)
    torch.testing.assert_close(result.scores, reference(model, PROMPT, expected, "input_x_gradient"), rtol=1e-9,
                               atol=1e-12)  # fmt: skip


def test_bad_inputs_get_clear_errors():
    model = llama()
    with pytest.raises(ValueError, match=r"`input_ids` holds token ids outside the vocabulary \[0, 50\)"):
        attribute_generation(model, torch.tensor([1, 50]), generated=GENERATED)
    with pytest.raises(ValueError, match=r"`generated` holds token ids outside"):
        attribute_generation(model, PROMPT, generated=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="`generated` is empty"):
        attribute_generation(model, PROMPT, generated=torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one of `generated`"):
        attribute_generation(model, PROMPT)
    with pytest.raises(ValueError, match="exactly one of `generated`"):
        attribute_generation(model, PROMPT, generated=GENERATED, max_new_tokens=3)
    with pytest.raises(ValueError, match="`method` must be one of"):
        attribute_generation(model, PROMPT, generated=GENERATED, method="lrp")
    with pytest.raises(ValueError, match="`target_batch` must be a positive int"):
        attribute_generation(model, PROMPT, generated=GENERATED, target_batch=0)
    with pytest.raises(ValueError, match="`baseline_token` must be a token id"):
        attribute_generation(model, PROMPT, generated=GENERATED, method="integrated_gradients", baseline_token=99)
    with pytest.raises(ValueError, match="a base model without its LM head"):
        attribute_generation(model.model, PROMPT, generated=GENERATED)


def test_the_model_is_left_as_found():
    model = llama().train()
    model.model.layers[0].mlp.requires_grad_(False)
    sentinel = torch.ones_like(model.lm_head.weight)
    model.lm_head.weight.grad = sentinel
    before = hook_state(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        for method in ("saliency", "integrated_gradients"):
            attribute_generation(model, PROMPT, generated=GENERATED[:3], method=method, steps=3)
        attribute_generation(model, PROMPT, max_new_tokens=2)
        assert not torch.is_grad_enabled()
    assert hook_state(model) == before
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(m.training for m in model.modules())
    assert model.lm_head.weight.grad is sentinel
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")


@pytest.mark.parametrize("error", [ZeroDivisionError, KeyboardInterrupt])
@pytest.mark.parametrize("method", ["input_x_gradient", "integrated_gradients"])
def test_an_error_inside_leaves_the_model_as_found(error, method):
    model = llama()
    before = hook_state(model)

    def fail(module, args, output):
        raise error

    model.model.layers[1].mlp.register_forward_hook(fail)
    with_hook = hook_state(model)
    with pytest.raises(error):
        attribute_generation(model, PROMPT, generated=GENERATED, method=method, steps=3)
    assert hook_state(model) == with_hook != before
    assert all(p.requires_grad for p in model.parameters()) and torch.is_grad_enabled()


# -- captum ----------------------------------------------------------------------------------------------------------
class IdTokenizer:
    """Text is ``"t3 t17 t5"``: one token per word; what captum's TextTokenInput and pretty tokens need."""

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = [int(w[1:]) for w in text.split()]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def decode(self, ids):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(f"t{i}" for i in ([ids] if isinstance(ids, int) else ids))

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
        offsets, start = [], 0
        for word in text.split():
            start = text.index(word, start)
            offsets.append((start, start + len(word)))
            start += len(word)
        return {"input_ids": self.encode(text), "offset_mapping": offsets}


def captum_token_attr(model, method, generated, steps=8, baseline_token=0, gen_args=None):
    attr = pytest.importorskip("captum.attr")
    tokenizer = IdTokenizer()
    embedding = model.get_input_embeddings()
    if method == "integrated_gradients":
        inner = attr.LayerIntegratedGradients(model, embedding)
        kwargs = {"n_steps": steps}
    else:
        inner = attr.LayerGradientXActivation(model, embedding, multiply_by_inputs=method == "input_x_gradient")
        kwargs = {}
    llm = attr.LLMGradientAttribution(inner, tokenizer)
    text = tokenizer.decode(PROMPT)
    prompt = attr.TextTokenInput(text, tokenizer, baselines=baseline_token)
    target = None if generated is None else generated
    result = llm.attribute(prompt, target=target, gen_args=gen_args, **kwargs)
    return result.token_attr, result.output_tokens


@pytest.mark.peers
@pytest.mark.parametrize("method", ["saliency", "input_x_gradient", "integrated_gradients"])
@pytest.mark.parametrize("build", [llama, gpt2])
def test_equals_captum_llm_gradient_attribution_token_by_token(method, build):
    model = build()
    expected, _ = captum_token_attr(model, method, GENERATED, steps=8, baseline_token=5)
    result = attribute_generation(model, PROMPT, generated=GENERATED, method=method, steps=8, baseline_token=5,
                                  target_batch=3)  # fmt: skip
    assert expected.shape == (7, 6)
    if method == "integrated_gradients":
        # captum rounds the Gauss-Legendre weights to float32 (`torch.tensor(step_sizes).float()` in
        # integrated_gradients.py), about 6e-8 of each weight; ours stay float64 (they match the slow float64
        # reference above to 1e-9)
        torch.testing.assert_close(result.scores[:, :6], expected, rtol=1e-5, atol=1e-8)
    else:
        torch.testing.assert_close(result.scores[:, :6], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.peers
def test_equals_captum_with_its_own_greedy_generation():
    model = llama()
    expected, tokens = captum_token_attr(model, "input_x_gradient", None,
                                         gen_args={"max_new_tokens": 6, "do_sample": False})  # fmt: skip
    result = attribute_generation(model, PROMPT, max_new_tokens=6)
    assert [f"t{i}" for i in result.generated.tolist()] == tokens
    torch.testing.assert_close(result.scores[:, :6], expected, rtol=1e-9, atol=1e-12)
