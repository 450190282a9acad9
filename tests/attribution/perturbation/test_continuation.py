"""A continuation as the target: each of its tokens' log-probability after the perturbed prompt, teacher-forced.

Checked against full re-runs of ``prompt + continuation`` written out here (no cache), the cached and the plain
evaluations against each other, and exact Shapley values from every coalition.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attribution import LIME, FeatureAblation, KernelSHAP, ShapleyValues, ShapleyValueSampling
from attribution.perturbation import Continuation

from ..models import lm64

ROUNDING = {"rtol": 1e-9, "atol": 1e-11}  # the cached and the full attention sum in another order
PROMPTS = torch.tensor([[5, 9, 3, 17, 22, 8], [1, 12, 3, 4, 25, 0]])  # the last 0: ablating it changes nothing
GENERATED = torch.tensor([[7, 30, 2], [11, 7, 19]])


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return lm64(request.param)


def log_probs(model, prompt: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """``(N,)`` log p(g_i | prompt, g_<i), from one full forward of ``prompt + generated`` (no cache)."""
    ids = torch.cat([prompt, generated])[None]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    p = len(prompt)
    return torch.log_softmax(logits[p - 1 : p - 1 + len(generated)], -1).gather(1, generated[:, None])[:, 0]


def test_feature_ablation_of_a_continuation_is_the_drop_of_each_tokens_log_probability(model):
    got = FeatureAblation(model, baseline=0, perturbations_per_forward=4)(PROMPTS, Continuation(GENERATED))
    assert got.shape == (2, 3, 6)
    for b in range(2):
        full = log_probs(model, PROMPTS[b], GENERATED[b])
        for j in range(6):
            ablated = PROMPTS[b].clone()
            ablated[j] = 0
            torch.testing.assert_close(got[b, :, j], full - log_probs(model, ablated, GENERATED[b]), **ROUNDING)
    alone = FeatureAblation(model, baseline=0, perturbations_per_forward=1)(PROMPTS[1:], Continuation(GENERATED[1]))
    torch.testing.assert_close(alone, got[1:], **ROUNDING)
    torch.testing.assert_close(alone[0, :, 5], torch.zeros(3, dtype=torch.float64), **ROUNDING)


@pytest.mark.parametrize("name", ["ablation", "sampling", "kernel", "lime"])
def test_the_reused_prefix_equals_the_plain_rerun_for_a_continuation(model, name):
    mask = torch.tensor([0, 1, 1, 2, 3, 4])
    build = {
        "ablation": lambda reuse: FeatureAblation(model, mask, 0, perturbations_per_forward=3, reuse=reuse),
        "sampling": lambda reuse: ShapleyValueSampling(model, mask, 0, samples=2, reuse=reuse),
        "kernel": lambda reuse: KernelSHAP(model, mask, 0, samples=12, reuse=reuse),
        "lime": lambda reuse: LIME(model, mask, 0, samples=12, reuse=reuse),
    }[name]
    target = Continuation(GENERATED[0])  # one continuation for both prompts
    torch.testing.assert_close(build(True)(PROMPTS, target), build(False)(PROMPTS, target), **ROUNDING)


def test_exact_shapley_values_of_each_token_from_every_coalition(model):
    prompt, generated = PROMPTS[0, :4], GENERATED[0]
    values = {}
    for kept in itertools.product([False, True], repeat=4):
        ids = torch.where(torch.tensor(kept), prompt, torch.zeros_like(prompt))
        values[kept] = log_probs(model, ids, generated)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(4):
        for kept, value in values.items():
            if not kept[i]:
                size = sum(kept)
                weight = math.factorial(size) * math.factorial(4 - size - 1) / math.factorial(4)
                added = tuple(k or j == i for j, k in enumerate(kept))
                expected[:, i] += weight * (values[added] - value)
    got = ShapleyValues(model, baseline=0)(prompt[None], Continuation(generated))
    torch.testing.assert_close(got[0], expected, **ROUNDING)
    torch.testing.assert_close(KernelSHAP(model, baseline=0)(prompt[None], Continuation(generated))[0], expected)


def test_a_continuation_needs_a_causal_lms_token_ids_and_ids_in_its_vocabulary(model):
    with pytest.raises(TypeError, match="needs token ids"):
        FeatureAblation(torch.nn.Linear(3, 2))(torch.randn(1, 3), Continuation(torch.tensor([1])))
    with pytest.raises(ValueError, match=r"ids in \[0, 40\)"):
        FeatureAblation(model)(PROMPTS, Continuation(torch.tensor([3, 40])))
    with pytest.raises(ValueError, match=r"\(N,\) or \(batch, N\)"):
        FeatureAblation(model)(PROMPTS, Continuation(torch.zeros(3, 2, dtype=torch.long)))
    with pytest.raises(TypeError, match="integer token ids"):
        FeatureAblation(model)(PROMPTS, Continuation(torch.zeros(2)))
