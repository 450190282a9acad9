"""Explanations and their scores: metrics worked out by hand, oracle/constant/coin-flip simulators on a real report,
malformed replies, and the local-model path on a tiny random Llama checked against a slow re-computation."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from attribution.features import Neurons, feature_statistics
from attribution.features.explanations import (
    Explanation,
    binary_probability,
    detection_metrics,
    expected_value,
    explain,
    parse_explanation,
    score,
    simulation_score,
)

transformers = pytest.importorskip("transformers")
ex = importlib.import_module("attribution.features.explanations")  # the module (the family exports its functions)

SPECIAL = ["[PAD]", "<s>", "</s>", "[UNK]"]
VOCAB = SPECIAL + [str(v) for v in range(11)] + [f"w{i}" for i in range(49)]  # 64 words


class Words:
    """A minimal stand-in tokenizer: whitespace-separated words, unknown words as [UNK]."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    chat_template = None

    def __len__(self) -> int:
        return len(VOCAB)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [VOCAB.index(w) if w in VOCAB else 3 for w in text.split()]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(VOCAB[i] for i in ids if not (skip_special_tokens and i < 3))


def _tokenizer():
    try:
        import tokenizers
    except ImportError:
        return Words()
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="[PAD]", bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    )


def _llama(seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def report(tok):
    generator = torch.Generator().manual_seed(0)
    docs = torch.randint(4, len(VOCAB), (60, 24), generator=generator)
    docs[:, 0] = 1  # BOS: shown nowhere, scored nowhere
    return feature_statistics(
        _llama(0), docs, Neurons(1, indices=range(8)), tokenizer=tok, k=20, context=(6, 3), bands=4, progress=False
    )


@pytest.fixture(scope="module")
def lm(tok):
    return _llama(1, torch.float64), tok


def _texts(report, example):
    """An example's token texts and activations, BOS/pad/EOS left out (written here, not taken from the module)."""
    special = set(report.settings["special_ids"])
    kept = [(t, a) for t, a in zip(example.tokens, example.activations, strict=True) if t not in special]
    return tuple(report.tokenizer.decode([t]) for t, _ in kept), [a for _, a in kept]


def _table(report, unit):
    """token texts -> (activations, the example's value) over every example the report keeps of ``unit``."""
    examples = report.top(unit) + [e for band in report.bands(unit) for e in band] + report.non_activating(unit)
    return {_texts(report, e)[0]: (_texts(report, e)[1], e.value) for e in examples}


# -- metrics by hand --------------------------------------------------------------------------------------------------
def test_detection_metrics_on_a_hand_made_confusion_matrix():
    # truth 1 1 1 0 0 with answers yes yes no yes no: TP 2, FN 1, FP 1, TN 1
    m = detection_metrics([1, 1, 1, 0, 0], [0.9, 0.8, 0.2, 0.7, 0.1])
    assert (m["tp"], m["fn"], m["fp"], m["tn"]) == (2, 1, 1, 1)
    assert m["balanced_accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert m["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["auroc"] == pytest.approx(5 / 6)  # positive/negative pairs won: 0.9 (2), 0.8 (2), 0.2 (1 of 2)
    # all answers 0.5 (all "no"): every pair tied
    tied = detection_metrics([1, 0, 1, 0], [0.5] * 4)
    assert tied["auroc"] == 0.5 and tied["balanced_accuracy"] == 0.5 and tied["f1"] == 0.0
    # ties count one half: pairs (0.6 vs 0.6) tie, (0.6 vs 0.1) won, (0.3 vs 0.6) lost, (0.3 vs 0.1) won
    assert detection_metrics([1, 1, 0, 0], [0.6, 0.3, 0.6, 0.1])["auroc"] == pytest.approx(2.5 / 4)
    perfect = detection_metrics([0, 1, 0, 1], [0.0, 1.0, 0.2, 0.9])
    assert perfect["balanced_accuracy"] == perfect["f1"] == perfect["auroc"] == 1.0
    one_class = detection_metrics([0, 0], [0.0, 0.0])
    assert one_class["balanced_accuracy"] is None and one_class["auroc"] is None and one_class["f1"] is None


def test_coin_flips_score_one_half():
    rng = random.Random(0)
    truth = [rng.random() < 0.3 for _ in range(4000)]
    coin = [float(rng.random() < 0.5) for _ in truth]
    m = detection_metrics(truth, coin)
    assert abs(m["balanced_accuracy"] - 0.5) < 0.03 and abs(m["auroc"] - 0.5) < 0.03


def test_pearson_over_the_concatenation_is_not_the_mean_per_passage():
    truth, predicted = [[0.0, 1.0], [10.0, 11.0]], [[1.0, 0.0], [10.0, 11.0]]
    # per passage r = -1 and +1 (mean 0); concatenated, deviations from 5.5: x.y = 100, |x|^2 = |y|^2 = 101
    per_passage = [simulation_score([t], [p]) for t, p in zip(truth, predicted, strict=True)]
    assert per_passage == [pytest.approx(-1.0), pytest.approx(1.0)]
    assert simulation_score(truth, predicted) == pytest.approx(100 / 101)
    assert simulation_score([[1.0, 2.0, 4.0]], [[3.0, 3.0, 3.0]]) is None  # constant prediction: undefined, not 0
    assert simulation_score([[0.1] * 3], [[1.0, 2.0, 3.0]]) is None  # constant truth
    assert simulation_score([[1.0, float("nan"), 3.0]], [[1.0, 5.0, 2.0]]) == pytest.approx(1.0)  # NaN pair dropped
    with pytest.raises(ValueError, match="passage 0 has 2 tokens but 1 predictions"):
        simulation_score([[1.0, 2.0]], [[1.0]])


def test_expected_value_and_binary_probability_by_hand():
    p = torch.zeros(11, dtype=torch.float64)
    p[0], p[3], p[10] = 0.1, 0.2, 0.1  # renormalised: 1/4, 1/2, 1/4
    assert float(expected_value(p)) == pytest.approx(0 / 4 + 3 / 2 + 10 / 4)
    assert float(expected_value(torch.tensor([0.5, 0.5]), torch.tensor([2.0, 4.0]))) == 3.0
    assert expected_value(torch.eye(3, dtype=torch.float64)).tolist() == [0.0, 1.0, 2.0]
    assert binary_probability(0.2, 0.6) == pytest.approx(0.75)
    assert binary_probability(0.6, 0.2) == pytest.approx(0.25)
    assert binary_probability(0.0, 0.0) == 0.5


def test_parse_explanation():
    assert parse_explanation("Let me see.\nExplanation: 'w3' after w7.\n") == "'w3' after w7"  # not a pair of quotes
    assert parse_explanation('[EXPLANATION]: "numbers in lists".') == "numbers in lists"
    assert parse_explanation("explanation:\n\n  dates\nmore") == "dates"
    assert parse_explanation("dates") == "" and parse_explanation("Explanation:   ") == ""
    assert parse_explanation(" dates.", started=True) == "dates"


def test_prompts_are_in_the_module_doc():
    doc = " ".join(ex.__doc__.split())
    for prompt in (ex.EXPLAINER_PROMPT, ex.SIMULATION_PROMPT, ex.DETECTION_PROMPT, ex.FUZZING_PROMPT):
        assert " ".join(prompt.split()) in doc


# -- examples shown and scored -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("examples", "seed"), [(10, 0), (3, 1), (2, 7)])
def test_scored_examples_never_overlap_shown_ones(report, examples, seed):
    width = sum(report.settings["context"]) + 1
    for unit in range(len(report)):
        shown = ex._split(report, unit, examples, seed, "explain").shown
        held = ex._split(report, unit, 10, seed + 1, "score")
        assert 0 < len(shown) <= examples and held.activating and held.quiet
        assert all(e in report.top(unit)[0::2] for e in shown)
        for e in held.activating + held.quiet:
            assert all(
                e.document != s.document or abs(e.position - s.position) >= width for s in report.top(unit)[0::2]
            )
        assert all(e.value > 0 for e in held.activating) and all(e.value <= 0 for e in held.quiet)
    again = ex._split(report, 0, 4, 3, "score")
    assert again == ex._split(report, 0, 4, 3, "score")  # seeded


def test_explainer_sees_marked_top_examples(report):
    prompts = []

    def explainer(prompt: str) -> str:
        prompts.append(prompt)
        return "Some thoughts first.\nExplanation: the token w7."

    out = explain(report, [0, "L1/N3"], explainer, examples=4)
    assert out == {0: "the token w7", "L1/N3": "the token w7"} and not any(e.malformed for e in out.values())
    assert len(prompts) == 2 and all(p.count("Passage ") == 4 and "Active tokens: (" in p for p in prompts)
    first = report.top(0)[0]
    own = report.tokenizer.decode([first.tokens[first.offset]])
    assert f'("{own}", 10)' in prompts[0]  # the top example's own token: marked, the largest value rescaled to 10
    assert prompts[0].count("<<") == prompts[0].count(">>") >= 4
    assert "<s>" not in prompts[0]


def test_malformed_replies_are_kept_and_marked(report):
    replies = {0: "", 1: "I am not sure what this is.", 2: None, 3: "Explanation: quotes", 4: "Explanation:\n\n"}
    calls = iter(range(5))

    def explainer(prompt: str):
        return replies[next(calls)]

    with pytest.warns(UserWarning, match=r"units \[0, 1, 2, 4\] hold no explanation") as caught:
        out = explain(report, [0, 1, 2, 3, 4], explainer)
    assert len(caught) == 1
    assert out == {0: "", 1: "", 2: "", 3: "quotes", 4: ""}
    assert [out[u].malformed for u in range(5)] == [True, True, True, False, True]
    assert out[1].raw == "I am not sure what this is." and out[2].raw == "None" and out[3].raw == "Explanation: quotes"
    constant = {u: "whatever" if e else e for u, e in out.items()}
    with pytest.warns(UserWarning, match=r"units \[0, 1, 2, 4\] have empty"):
        scores = score(report, constant, "detection", lambda e, t: 1.0)
    assert scores == {0: None, 1: None, 2: None, 3: 0.5, 4: None}  # always "yes": TPR 1, TNR 0


# -- scorers on a real report ------------------------------------------------------------------------------------------
def test_oracle_simulator_scores_one_and_constant_none(report, no_warnings):
    explanations = {u: f"unit {u}" for u in range(len(report))}
    tables = {u: _table(report, u) for u in range(len(report))}
    seen = []

    def oracle(explanation: str, tokens: list[str]) -> list[float]:
        seen.append(len(tokens))
        return tables[int(explanation.split()[1])][tuple(tokens)][0]

    scores = score(report, explanations, "simulation", oracle, examples=6)
    assert all(s == pytest.approx(1.0, abs=1e-12) for s in scores.values()), scores
    held = [ex._split(report, u, 6, 0, "score") for u in range(len(report))]
    assert len(seen) == sum(len(h.activating) + len(h.quiet) for h in held) >= len(report) * 6
    assert score(report, explanations, "simulation", lambda e, t: [3.0] * len(t)) == dict.fromkeys(explanations)
    # not the mean per passage: the oracle's predictions shuffled within each passage still correlate overall
    shuffled = score(report, explanations, "simulation", lambda e, t: sorted(oracle(e, t)), examples=6)
    assert all(s is not None and s < 1 for s in shuffled.values())


def test_perfect_detector_and_coin_flips(report, no_warnings):
    explanations = {u: f"unit {u}" for u in range(len(report))}
    tables = {u: _table(report, u) for u in range(len(report))}

    def perfect(explanation: str, tokens: list[str]) -> float:
        return float(tables[int(explanation.split()[1])][tuple(tokens)][1] > 0)

    assert score(report, explanations, "detection", perfect) == dict.fromkeys(explanations, 1.0)
    for metric in ("f1", "auroc", "accuracy"):
        assert score(report, explanations, "detection", perfect, metric=metric) == dict.fromkeys(explanations, 1.0)
    rng = random.Random(0)
    coin = score(report, explanations, "detection", lambda e, t: rng.random() < 0.5, examples=20)
    assert abs(sum(coin.values()) / len(coin) - 0.5) < 0.12, coin  # 8 units x about 25 passages


def test_perfect_fuzzing_judge(report, no_warnings):
    explanations = {u: f"unit {u}" for u in range(len(report))}
    tables = {u: _table(report, u) for u in range(len(report))}
    asked = []

    def judge(explanation: str, tokens: list[str], marked: list[bool]) -> int:
        unit = int(explanation.split()[1])
        acts, value = tables[unit][tuple(tokens)]
        least = min(float(report.max[unit]) / 10, value)
        asked.append(any(marked))
        return int(value > 0 and marked == [a > 0 and a >= least for a in acts])

    assert score(report, explanations, "fuzzing", judge) == dict.fromkeys(explanations, 1.0)
    assert all(asked)
    assert score(report, explanations, "fuzzing", lambda e, t, m: 0.5) == dict.fromkeys(explanations, 0.5)


def test_bad_simulator_replies_make_that_unit_none(report):
    def simulator(explanation: str, tokens: list[str]):
        return [1.0] if explanation == "short" else list(range(len(tokens)))

    with pytest.warns(UserWarning, match=r"units \[1\] were not one number per token"):
        scores = score(report, {0: "fine", 1: "short"}, "simulation", simulator)
    assert scores[1] is None and isinstance(scores[0], float)
    with pytest.warns(UserWarning, match=r"units \[0\] were not a probability"):
        assert score(report, {0: "x"}, "detection", lambda e, t: 2.0) == {0: None}
    with pytest.raises(ValueError, match="`scorer` must be"):
        score(report, {0: "x"}, "simulate", simulator)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`metric` must be"):
        score(report, {0: "x"}, "simulation", simulator, metric="f1")
    with pytest.raises(TypeError, match="`simulator` is needed"):
        score(report, {0: "x"}, "simulation")
    with pytest.raises(KeyError, match="no unit is labelled 'L9/N9'"):
        score(report, {"L9/N9": "x"}, "simulation", simulator)


# -- a local language model --------------------------------------------------------------------------------------------
def test_local_explainer_runs_batched_and_deterministic(report, tok):
    model = _llama(2)
    model.train()
    first = explain(report, [0, 1, 2], (model, tok), batch_size=2, max_new_tokens=6)
    second = explain(report, [0, 1, 2], (model, tok), batch_size=3, max_new_tokens=6)
    assert model.training and all(m.training for m in model.modules())  # left as found
    assert list(first) == [0, 1, 2] and all(isinstance(e, Explanation) for e in first.values())
    assert first == second and [e.raw for e in first.values()] == [e.raw for e in second.values()]
    assert all(len(e.raw.split()) <= 6 for e in first.values())


def _slow_expected_values(model, tok, ids, slots):
    """One forward per slot, unbatched: the expected value over 0..10 of the digits' next-token probabilities."""
    out = []
    for slot in slots:
        with torch.no_grad():
            p = model(torch.tensor([ids[: slot + 1]])).logits[0, -1].double().softmax(-1)
        by_value = torch.zeros(11, dtype=torch.float64)
        for i in range(len(VOCAB)):
            text = tok.decode([i]).strip()
            if text in [str(v) for v in range(11)]:
                by_value[int(text)] += p[i]
        out.append(float((by_value * torch.arange(11)).sum() / by_value.sum()))
    return out


def test_local_simulator_reads_the_digits_all_at_once(report, lm):
    model, tok = lm
    reader = ex._Reader(report)
    split = ex._split(report, 0, 3, 0, "score")
    items = [ex._Item(0, reader.passage(e), None, True) for e in split.activating + split.quiet]
    said = ["w5 after w9"] * len(items)
    fast = ex._lm_answers(ex._LM(lm, "simulator"), "simulation", items, said, batch_size=4)
    assert [len(f) for f in fast] == [len(it.passage.tokens) for it in items]
    for it, predicted in zip(items, fast, strict=True):
        ids, slots = ex._simulation_ids(ex._LM(lm, "simulator"), "w5 after w9", it.passage.tokens)
        assert [tok.decode([ids[s]]) for s in slots] == list(it.passage.tokens)  # each slot ends its token's line
        torch.testing.assert_close(predicted, _slow_expected_values(model, tok, ids, slots))
        assert all(0 <= v <= 10 for v in predicted)
    explanations = {0: "w5 after w9", 1: "w3"}
    first = score(report, explanations, "simulation", lm, examples=3, batch_size=5)
    assert first == score(report, explanations, "simulation", lm, examples=3, batch_size=2)
    assert all(s is None or -1 <= s <= 1 for s in first.values())


def test_local_detection_reads_p1_over_p0_plus_p1(report, lm):
    model, tok = lm
    reader = ex._Reader(report)
    split = ex._split(report, 2, 2, 0, "score")
    items = [ex._Item(0, reader.passage(e), None, e.value > 0) for e in split.activating + split.quiet]
    fast = ex._lm_answers(ex._LM(lm, "simulator"), "detection", items, ["w4"] * len(items), batch_size=3)
    for it, p in zip(items, fast, strict=True):
        prompt = ex.DETECTION_PROMPT.format(explanation="w4", passage="".join(it.passage.tokens))
        ids = [1, *tok.encode(f"{prompt}\n\nAnswer:", add_special_tokens=False)]
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
        p0, p1 = probs[VOCAB.index("0")], probs[VOCAB.index("1")]
        assert p == pytest.approx(float(p1 / (p0 + p1)), rel=1e-12)
    for scorer in ("detection", "fuzzing"):
        scores = score(report, {0: "w4", 5: "w8"}, scorer, lm, examples=2)
        assert scores == score(report, {0: "w4", 5: "w8"}, scorer, lm, examples=2, batch_size=1)
        assert all(s is None or 0 <= s <= 1 for s in scores.values())


def test_chat_template_starts_the_users_turn(tok):
    if isinstance(tok, Words):
        pytest.skip("the stand-in tokenizer has no chat template")
    chat = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, bos_token="<s>", eos_token="</s>"
    )
    chat.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
    lm = ex._LM((_llama(3), chat), "explainer")
    assert lm.start("w1 w2", "Answer:") == [1, VOCAB.index("w1"), VOCAB.index("w2"), 2, 3]
    assert ex._LM((_llama(3), tok), "explainer").start("w1", "0") == [1, VOCAB.index("w1"), VOCAB.index("0")]
