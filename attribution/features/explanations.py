r"""Automated interpretability: units explained in words, and the explanations scored on held-out examples.

:func:`explain` shows an *explainer* a unit's top examples and asks it for a short phrase; :func:`score` measures
how well that phrase lets a *simulator* predict the unit on examples the explainer never saw. The explainer and the
simulator are either a local HuggingFace causal language model given as ``(model, tokenizer)`` or a Python callable
(an API client, a person, an oracle in a test).

Scorers
    ``"simulation"`` (Bills et al. 2023, `Language models can explain neurons in language models
    <https://openaipublic.blob.core.windows.net/neuron-explainer/paper/index.html>`_): the simulator predicts the
    activation, 0 to 10, of every token of every scored passage from the explanation alone. The score is Pearson's
    r between the predictions and the true activations over *all* scored tokens concatenated (activating and
    non-activating passages together, as OpenAI's "all at once" scoring does), which is not the mean of the
    per-passage correlations. ``"detection"`` and ``"fuzzing"`` (Paulo et al. 2024, `Automatically interpreting
    millions of features in large language models <https://arxiv.org/abs/2410.13928>`_, the delphi library):
    detection asks, for each scored passage, whether the unit is active anywhere in it (activating passages against
    :meth:`~attribution.features.UnitReport.non_activating` ones); fuzzing marks tokens of a passage and asks
    whether the marks are right (activating passages with their active tokens marked, against the same passages and
    the non-activating ones with as many tokens marked at random). Each answer is a probability of "yes"; a
    passage counts as "yes" when it is above 0.5.

    =============  =====================================================  ==========================================
    scorer         ``score`` returns (``metric=``)                        ``None`` (undefined) when
    =============  =====================================================  ==========================================
    simulation     Pearson r over all scored tokens concatenated          predictions or truth constant, < 2 tokens
    detection      balanced accuracy ``(TPR + TNR) / 2`` (default),       no activating or no non-activating
                   ``"f1"``: ``2 TP / (2 TP + FP + FN)``, ``"auroc"``:    passage (F1: no positive passage and no
                   area under the ROC curve of the probabilities (ties    "yes" answer)
                   count one half), ``"accuracy"``
    fuzzing        as detection (correctly marked passages are positive)  as detection
    =============  =====================================================  ==========================================

    An empty (malformed) explanation scores ``None``, with a warning. :func:`detection_metrics` gives all the
    metrics of one set of answers at once.

Which examples are shown and which are scored
    A unit's top examples (:meth:`~attribution.features.UnitReport.top`, value descending) are split by rank: the
    explainer is shown the even ranks (0, 2, 4, ...; ``examples`` of them, drawn with ``seed`` when there are more).
    The scorers use, as activating passages, the odd ranks (1, 3, ...) and the band samples
    (:meth:`~attribution.features.UnitReport.bands`, ``"interval"``), and as non-activating passages the
    :meth:`~attribution.features.UnitReport.non_activating` samples; ``examples`` of each, drawn with ``seed``. Every
    scored passage whose context overlaps the context of an even-ranked example is left out, whatever ``examples``
    and ``seed`` of the two calls: no token the explainer could have seen is scored. Only examples with a value
    above 0 count as activating.

Passages
    A passage is an example's context, decoded token by token with the report's tokenizer (``[id]`` without one),
    with the BOS/pad/EOS ids of the run left out (they are not scored either); tabs, newlines and carriage returns
    in a token are written ``\t``, ``\n``, ``\r``. Activations are shown rescaled to whole numbers, OpenAI's way:
    ``floor(10 a / m)`` clipped to 0..10, ``m`` the unit's largest activation over the dataset (``report.max``).
    The *active tokens* of a passage, marked ``<<like this>>`` (delphi's marks; runs of active tokens share one pair)
    are those with an activation above 0 and at least ``min(m / 10, v)``, ``v`` the example's own value; a marked
    token is shown as at least 1.

Prompts (written for this library; ``{...}`` are filled in)
    Explainer::

        We are studying one unit of a neural network that reads text: a neuron, a dictionary feature or a direction.
        Below are passages of a dataset on which the unit is strongly active. Its activation on each token is
        rescaled to a whole number from 0 (inactive) to 10 (the strongest seen). In every passage the active tokens
        are put between << and >>, and the line after the passage lists them with their activations.

        Work out what the unit responds to: the kind of token that activates it and, where it matters, the context
        around that token. Describe it in one short phrase. Do not list the marked tokens one by one, do not mention
        the << >> marks, and give one description, not several.

        {passages}

        End your reply with one line of the form
        Explanation: <the phrase>

    with ``{passages}`` one block per example: ``Passage 1: the cat sat on the <<mat>> and`` and below it
    ``Active tokens: ("mat", 10)``. Simulation::

        We are studying one unit of a neural network that reads text. Its activation on each token is a whole number
        from 0 (inactive) to 10 (the strongest); on most tokens it is 0.
        What the unit responds to: {explanation}

        Predict the unit's activation on every token of the passage below. Each line holds one token, a tab and the
        activation; an activation not predicted yet is written ?.

    followed by one line ``token<TAB>?`` per token. Detection::

        We are studying one unit of a neural network that reads text.
        What the unit responds to: {explanation}

        Judging by that description, is the unit active anywhere in the passage below?
        Passage: {passage}

        Answer with one digit: 1 if it is active, 0 if it is not.

    Fuzzing::

        We are studying one unit of a neural network that reads text.
        What the unit responds to: {explanation}

        In the passage below some tokens are put between << and >>. Judging by that description, are the marked
        tokens the ones on which the unit is active?
        Passage: {passage}

        Answer with one digit: 1 if the marks are right, 0 if they are not.

    Explanations are parsed from the text after the last ``Explanation:`` (or ``[EXPLANATION]:``, any case): its
    first non-empty line, stripped of quotes and a final full stop. A reply without it, or with nothing after it,
    is malformed: the unit's explanation is ``""``, with the reply kept in :attr:`Explanation.raw` and a warning
    naming the units; the other units are not affected.

Callables
    ``explainer(prompt) -> str`` (the reply). Simulators, by scorer: ``"simulation"``:
    ``simulator(explanation, tokens) -> list[float]``, one prediction per token of the passage (``tokens`` the
    passage's token texts); ``"detection"``: ``simulator(explanation, tokens) -> float``, the probability (or 0/1)
    that the unit is active in the passage; ``"fuzzing"``: ``simulator(explanation, tokens, marked) -> float``,
    ``marked`` a list of ``bool`` per token, the probability (or 0/1) that the marks are right. A reply of the wrong
    kind makes the unit's score ``None``, with a warning. Errors the callable raises are not caught.

Local language models ``(model, tokenizer)``
    Run on the model's device in eval mode (the model's state is restored afterwards), without gradients. The
    prompt is the user turn of the tokenizer's chat template when it has one (``add_generation_prompt=True``), else
    BOS and the prompt and a blank line; the answer is started for the model: ``Explanation:`` for the explainer,
    ``Answer:`` for detection and fuzzing. The explainer generates greedily (``max_new_tokens``), units batched with
    left padding. The scorers run one forward per passage (``batch_size`` passages at a time, right padding) and
    read the next-token distribution: for simulation all at once, at the slot after each ``token<TAB>`` (each line
    encoded on its own, so the slots are known); for detection and fuzzing after ``Answer:``. The probability of a
    value ``v`` is the sum of the probabilities of the tokens whose text, stripped of white space, is ``str(v)``;
    values that no single token spells (``"10"`` with tokenizers that split digits) are left out and the others
    renormalised. Simulation predicts :func:`expected_value` over 0..10; detection and fuzzing answer
    :func:`binary_probability` ``P(1) / (P(0) + P(1))``.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .._run import warn
from ._lm import _LM, _simulation_ids
from ._passages import (
    DETECTION_PROMPT,
    EXPLAINER_PROMPT,
    FUZZING_PROMPT,
    SIMULATION_PROMPT,
    _explainer_prompt,
    _Passage,
    _Reader,
    _Split,
    _split,
    _with_marks,
    parse_explanation,
)
from ._scores import auroc, binary_probability, detection_metrics, expected_value, simulation_score
from .report import UnitReport

__all__ = [
    "Explanation",
    "explain",
    "score",
    "parse_explanation",
    "expected_value",
    "binary_probability",
    "simulation_score",
    "auroc",
    "detection_metrics",
    "EXPLAINER_PROMPT",
    "SIMULATION_PROMPT",
    "DETECTION_PROMPT",
    "FUZZING_PROMPT",
    "Unit",
    "Scorer",
    "Metric",
]

Unit = int | str
Scorer = Literal["simulation", "detection", "fuzzing"]
Metric = Literal["balanced_accuracy", "f1", "auroc", "accuracy"]


class Explanation(str):
    """An explanation: the parsed phrase (``""`` when the reply was malformed), with the explainer's reply kept.

    Example:
        >>> e = Explanation("", raw="I cannot tell.")
        >>> e == "", e.malformed, e.raw
        (True, True, 'I cannot tell.')
    """

    raw: str
    """The explainer's whole reply; for a local model, the text generated after ``Explanation:``."""

    def __new__(cls, text: str, raw: str = "") -> Explanation:
        """The explanation ``text``, from the reply ``raw``."""
        self = super().__new__(cls, text)
        self.raw = raw
        return self

    @property
    def malformed(self) -> bool:
        """Whether no explanation could be read from the reply."""
        return not self


# -- explain ------------------------------------------------------------------------------------------------------
def _unit_list(report: UnitReport, units: Unit | Sequence[Unit] | None) -> list[Unit]:
    """The units asked for, as given (every live unit for ``None``), each checked against the report."""
    if units is None:
        dead = set(report.dead)
        return [i for i in range(len(report)) if i not in dead]
    chosen: list[Unit] = [units] if isinstance(units, (int, str)) else list(units)
    for u in chosen:
        report.index(u)  # raises, naming the unit
    return chosen


def _check_counts(examples: int, seed: int, batch_size: int) -> None:
    """Refuse counts that are not integers in range, by name."""
    for name, value, low in (("examples", examples, 1), ("seed", seed, 0), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")


def _explainer_prompts(report: UnitReport, chosen: list[Unit], examples: int, seed: int) -> dict[int, str]:
    """The explainer's prompt per position in ``chosen``; none for a unit with no activating top example to show."""
    reader = _Reader(report)
    prompts: dict[int, str] = {}
    for position, unit in enumerate(chosen):
        index = report.index(unit)
        shown = [reader.passage(e) for e in _split(report, index, examples, seed, "explain").shown]
        if shown:
            prompts[position] = _explainer_prompt(shown, reader.scale(index))
    return prompts


def _ask_explainer(
    explainer: Callable[[str], str] | tuple[nn.Module, Any],
    prompts: dict[int, str],
    max_new_tokens: int,
    batch_size: int,
) -> tuple[dict[int, str], bool]:
    """The explainer's reply per prompt, and whether the replies continue an ``Explanation:`` already written."""
    if isinstance(explainer, tuple):
        lm = _LM(explainer, "explainer")
        order = list(prompts)
        starts = [lm.start(prompts[p], "Explanation:") for p in order]
        return dict(zip(order, lm.generate(starts, max_new_tokens, batch_size), strict=True)), True
    if callable(explainer):
        return {p: explainer(prompt) for p, prompt in prompts.items()}, False
    raise TypeError(f"`explainer` must be a callable or (model, tokenizer); got {type(explainer).__name__}")


def _parsed(
    chosen: list[Unit], prompts: dict[int, str], replies: dict[int, str], started: bool
) -> dict[Unit, Explanation]:
    """The explanation parsed from each unit's reply, with a warning naming the units left without one."""
    out: dict[Unit, Explanation] = {}
    silent, malformed = [], []
    for position, unit in enumerate(chosen):
        if position not in prompts:
            silent.append(unit)
            out[unit] = Explanation("", raw="")
            continue
        reply = replies[position]
        raw = reply if isinstance(reply, str) else repr(reply)
        text = parse_explanation(reply, started=started) if isinstance(reply, str) else ""
        if not text:
            malformed.append(unit)
        out[unit] = Explanation(text, raw=raw)
    if silent:
        warn(f"explain: units {silent} have no activating top example to show; their explanations are ''")
    if malformed:
        warn(
            f"explain: the explainer's replies for units {malformed} hold no explanation (no 'Explanation: ...' "
            "line, or nothing after it); their explanations are '' and the replies are kept in .raw"
        )
    return out


def explain(
    report: UnitReport,
    units: Unit | Sequence[Unit] | None,
    explainer: Callable[[str], str] | tuple[nn.Module, Any],
    *,
    examples: int = 10,
    seed: int = 0,
    max_new_tokens: int = 48,
    batch_size: int = 8,
) -> dict[Unit, Explanation]:
    """Explain units in words: an explainer reads each unit's top examples and names what they share.

    The prompt (module doc) shows the unit's even-ranked top examples with their active tokens marked; the odd
    ranks and the band samples are left for :func:`score`. A reply with no explanation in it is kept, marked and
    warned about (the unit's explanation is ``""``); it does not stop the other units.

    Args:
        report: the units' report (:func:`feature_statistics`).
        units: unit numbers or labels (one, a list, or ``None`` for every unit that is not dead); the keys of the
            result, as given.
        explainer: ``prompt -> reply`` callable, or ``(model, tokenizer)`` of a local HuggingFace causal LM.
        examples: top examples shown per unit (at most the even-ranked ones).
        seed: draws which even-ranked examples are shown when there are more than ``examples``.
        max_new_tokens: the longest reply of a local model.
        batch_size: units per generation of a local model.

    Returns:
        ``{unit: Explanation}``: a ``str``, ``""`` where the reply was malformed (``.raw`` holds the reply).

    Raises:
        TypeError: ``explainer`` of another kind.
        KeyError, IndexError: a unit the report does not have.

    Example:
        >>> import transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=8,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 40, (8, 10)), Neurons(0), k=4, context=(2, 2),
        ...     progress=False)
        >>> explain(report, [0, 1], lambda prompt: "Explanation: numbers in a list.")
        {0: 'numbers in a list', 1: 'numbers in a list'}
    """
    _check_counts(examples, seed, batch_size)
    chosen = _unit_list(report, units)
    prompts = _explainer_prompts(report, chosen, examples, seed)
    replies, started = _ask_explainer(explainer, prompts, max_new_tokens, batch_size)
    return _parsed(chosen, prompts, replies, started)


# -- score --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Item:
    """One question to a simulator: a passage, its marks (fuzzing) and the right answer."""

    unit: int
    passage: _Passage
    marked: list[bool] | None
    truth: bool


def _fuzz_items(position: int, reader: _Reader, index: int, split: _Split, rng: random.Random) -> list[_Item]:
    """Fuzzing's questions: held-out activating passages marked right, and marked at random; quiet ones at random."""
    scale = reader.scale(index)
    active = [reader.passage(e) for e in split.activating]
    right = [(p, p.marks(scale)) for p in active]
    items = [_Item(position, p, m, True) for p, m in right]
    counts = [sum(m) for _, m in right] or [1]
    for p, m in right:  # the same passage, as many tokens marked elsewhere
        n, count = len(p.tokens), sum(m)
        if 0 < count < n:
            while True:
                chosen = set(rng.sample(range(n), count))
                wrong = [i in chosen for i in range(n)]
                if wrong != m:
                    break
            items.append(_Item(position, p, wrong, False))
    for e in split.quiet:
        p = reader.passage(e)
        if p.tokens:
            chosen = set(rng.sample(range(len(p.tokens)), min(rng.choice(counts), len(p.tokens))))
            items.append(_Item(position, p, [i in chosen for i in range(len(p.tokens))], False))
    return items


def _probability(answer: Any) -> float | None:
    """A callable's answer as a probability in [0, 1] (``None`` if it is not one)."""
    if isinstance(answer, numbers.Real) and math.isfinite(answer) and 0 <= float(answer) <= 1:
        return float(answer)
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        return _probability(float(answer))
    return None


def _predictions(answer: Any, n: int) -> list[float] | None:
    """A callable's ``n`` predictions as floats (``None`` if they are not ``n`` numbers)."""
    try:
        values = [float(a) for a in answer]
    except (TypeError, ValueError):
        return None
    return values if len(values) == n else None


def _lm_answers(lm: _LM, scorer: Scorer, items: list[_Item], said: list[str], batch_size: int) -> list[Any]:
    """A local model's answers: expected values per token (simulation) or probabilities of "1"."""
    if scorer == "simulation":
        values = list(range(11))
        groups = lm.value_ids(values)
        present = torch.tensor([bool(g) for g in groups])
        built = [_simulation_ids(lm, e, it.passage.tokens) for it, e in zip(items, said, strict=True)]
        probs = lm.read([b[0] for b in built], [b[1] for b in built], groups, batch_size)
        scale = torch.tensor(values, dtype=torch.float64)[present]
        return [expected_value(p[:, present], scale).tolist() for p in probs]
    template = DETECTION_PROMPT if scorer == "detection" else FUZZING_PROMPT
    starts = []
    for it, e in zip(items, said, strict=True):
        text = "".join(it.passage.tokens) if it.marked is None else _with_marks(it.passage.tokens, it.marked)
        starts.append(lm.start(template.format(explanation=e, passage=text), "Answer:"))
    probs = lm.read(starts, [[len(s) - 1] for s in starts], lm.value_ids([0, 1]), batch_size)
    return [binary_probability(float(p[0, 0]), float(p[0, 1])) for p in probs]


def _callable_answers(ask: Callable[..., Any], scorer: Scorer, items: list[_Item], said: list[str]) -> list[Any]:
    """A callable's answers, one call per passage."""
    if scorer == "fuzzing":
        return [ask(e, list(it.passage.tokens), list(it.marked or [])) for it, e in zip(items, said, strict=True)]
    return [ask(e, list(it.passage.tokens)) for it, e in zip(items, said, strict=True)]


def _checked_simulator(
    report: UnitReport,
    explanations: dict[Unit, str],
    scorer: Scorer,
    simulator: Callable[..., Any] | tuple[nn.Module, Any] | None,
    counts: tuple[int, int, int],
    metric: Metric | None,
) -> _LM | None:
    """Refuse arguments of :func:`score` by name; the local model to ask (``None`` for a callable simulator)."""
    if scorer not in ("simulation", "detection", "fuzzing"):
        raise ValueError(f"`scorer` must be 'simulation', 'detection' or 'fuzzing'; got {scorer!r}")
    if metric is not None and (
        scorer == "simulation" or metric not in ("balanced_accuracy", "f1", "auroc", "accuracy")
    ):
        raise ValueError(
            f"`metric` must be None, or for detection and fuzzing 'balanced_accuracy', 'f1', 'auroc' or 'accuracy'; "
            f"got {metric!r} with scorer {scorer!r}"
        )
    if simulator is None:
        raise TypeError("`simulator` is needed: a callable (see the module doc) or (model, tokenizer) of a local LM")
    _check_counts(*counts)
    if not isinstance(explanations, dict):
        raise TypeError(f"`explanations` must be a dict {{unit: explanation}}; got {type(explanations).__name__}")
    for u in explanations:
        report.index(u)
        if not isinstance(explanations[u], str):
            raise TypeError(f"the explanation of unit {u!r} must be a str; got {type(explanations[u]).__name__}")
    lm = _LM(simulator, "simulator") if isinstance(simulator, tuple) else None
    if lm is None and not callable(simulator):
        raise TypeError(f"`simulator` must be a callable or (model, tokenizer); got {type(simulator).__name__}")
    return lm


def _score_items(
    report: UnitReport, keys: list[Unit], empty: list[Unit], scorer: Scorer, examples: int, seed: int
) -> list[_Item]:
    """The questions to the simulator for every unit with an explanation, passages with no token left out."""
    reader = _Reader(report)
    items: list[_Item] = []
    for position, unit in enumerate(keys):
        if unit in empty:
            continue
        index = report.index(unit)
        split = _split(report, index, examples, seed, "score")
        if scorer == "fuzzing":
            rng = random.Random(f"hookscope.features.explain/fuzz/{seed}/{index}")
            items += _fuzz_items(position, reader, index, split, rng)
        else:
            items += [_Item(position, reader.passage(e), None, True) for e in split.activating]
            items += [_Item(position, reader.passage(e), None, False) for e in split.quiet]
    return [item for item in items if item.passage.tokens]


def _unit_scores(
    scorer: Scorer, metric: Metric | None, keys: list[Unit], items: list[_Item], answers: list[Any]
) -> tuple[dict[Unit, float | None], list[Unit]]:
    """The score of each unit asked about, and the units whose replies were of the wrong kind (left unscored)."""
    per_unit: dict[int, list[tuple[_Item, Any]]] = {}
    for it, answer in zip(items, answers, strict=True):
        per_unit.setdefault(it.unit, []).append((it, answer))
    scores: dict[Unit, float | None] = {}
    broken: list[Unit] = []
    for position, pairs in per_unit.items():
        unit = keys[position]
        if scorer == "simulation":
            predicted = [_predictions(a, len(it.passage.tokens)) for it, a in pairs]
            if any(p is None for p in predicted):
                broken.append(unit)
                continue
            truth = [it.passage.activations for it, _ in pairs]
            scores[unit] = simulation_score(truth, [p for p in predicted if p is not None])
        else:
            prob = [_probability(a) for _, a in pairs]
            if any(p is None for p in prob):
                broken.append(unit)
                continue
            value = detection_metrics([it.truth for it, _ in pairs], [p for p in prob if p is not None])
            scores[unit] = value[metric or "balanced_accuracy"]
    return scores, broken


def score(
    report: UnitReport,
    explanations: dict[Unit, str],
    scorer: Scorer = "simulation",
    simulator: Callable[..., Any] | tuple[nn.Module, Any] | None = None,
    *,
    examples: int = 10,
    seed: int = 0,
    metric: Metric | None = None,
    batch_size: int = 8,
) -> dict[Unit, float | None]:
    """Score explanations by how well a simulator predicts each unit from its explanation alone, on held-out examples.

    ``"simulation"``: Pearson r of predicted (0..10) and true activations over all scored tokens concatenated
    (OpenAI). ``"detection"`` / ``"fuzzing"``: balanced accuracy of yes/no answers on activating against
    non-activating passages / correctly against wrongly marked ones (delphi); ``metric`` picks F1, AUROC or
    accuracy instead. Prompts, the examples used and the local-model reading are in the module doc.

    Args:
        report: the report the explanations were made from.
        explanations: ``{unit: explanation}`` (from :func:`explain`); the result has the same keys.
        scorer: ``"simulation"``, ``"detection"`` or ``"fuzzing"``.
        simulator: ``(model, tokenizer)`` of a local HuggingFace causal LM, or a callable (module doc).
        examples: held-out activating examples, and non-activating ones, scored per unit (at most).
        seed: draws the scored examples and fuzzing's random marks.
        metric: for detection and fuzzing: ``"balanced_accuracy"`` (default), ``"f1"``, ``"auroc"``, ``"accuracy"``.
        batch_size: passages per forward of a local model.

    Returns:
        ``{unit: score}``, ``None`` where the score is undefined (a constant prediction or truth, no examples of one
        kind), the explanation is empty, or the callable's reply was of the wrong kind (with a warning).

    Raises:
        ValueError: an unknown ``scorer`` or ``metric``.
        TypeError: no simulator, or one of another kind.

    Example:
        >>> import transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=8,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 40, (8, 10)), Neurons(0), k=6, context=(2, 2),
        ...     progress=False)
        >>> score(report, {0: "anything"}, "simulation", lambda explanation, tokens: [5.0] * len(tokens))
        {0: None}
    """
    lm = _checked_simulator(report, explanations, scorer, simulator, (examples, seed, batch_size), metric)
    keys = list(explanations)
    empty = [u for u in keys if not explanations[u].strip()]
    items = _score_items(report, keys, empty, scorer, examples, seed)
    said = [explanations[keys[it.unit]] for it in items]
    if lm is not None:
        answers = _lm_answers(lm, scorer, items, said, batch_size)
    else:
        answers = _callable_answers(cast(Callable[..., Any], simulator), scorer, items, said)
    scores, broken = _unit_scores(scorer, metric, keys, items, answers)
    out: dict[Unit, float | None] = {u: scores.get(u) for u in keys}
    if empty:
        warn(f"score: units {empty} have empty (malformed) explanations; their scores are None")
    if broken:
        kind = "one number per token" if scorer == "simulation" else "a probability in [0, 1] (or 0/1)"
        warn(f"score: the simulator's replies for units {broken} were not {kind}; their scores are None")
    return out
