"""Passages and prompts: examples as marked token texts, the shown/held-out split, the prompts and their parsing."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._inputs import decoder
from .report import Example, UnitReport

EXPLAINER_PROMPT = """\
We are studying one unit of a neural network that reads text: a neuron, a dictionary feature or a direction. \
Below are passages of a dataset on which the unit is strongly active. Its activation on each token is \
rescaled to a whole number from 0 (inactive) to 10 (the strongest seen). In every passage the active tokens \
are put between << and >>, and the line after the passage lists them with their activations.

Work out what the unit responds to: the kind of token that activates it and, where it matters, the context \
around that token. Describe it in one short phrase. Do not list the marked tokens one by one, do not mention \
the << >> marks, and give one description, not several.

{passages}

End your reply with one line of the form
Explanation: <the phrase>"""

SIMULATION_PROMPT = """\
We are studying one unit of a neural network that reads text. Its activation on each token is a whole number \
from 0 (inactive) to 10 (the strongest); on most tokens it is 0.
What the unit responds to: {explanation}

Predict the unit's activation on every token of the passage below. Each line holds one token, a tab and the \
activation; an activation not predicted yet is written ?."""

DETECTION_PROMPT = """\
We are studying one unit of a neural network that reads text.
What the unit responds to: {explanation}

Judging by that description, is the unit active anywhere in the passage below?
Passage: {passage}

Answer with one digit: 1 if it is active, 0 if it is not."""

FUZZING_PROMPT = """\
We are studying one unit of a neural network that reads text.
What the unit responds to: {explanation}

In the passage below some tokens are put between << and >>. Judging by that description, are the marked \
tokens the ones on which the unit is active?
Passage: {passage}

Answer with one digit: 1 if the marks are right, 0 if they are not."""

_MARKER = re.compile(r"\[?\s*explanation\s*\]?\s*:", re.IGNORECASE)
_ESCAPES = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


@dataclass(frozen=True)
class _Passage:
    """An example's context as token texts with the unit's activations, and the example's own value."""

    tokens: list[str]
    activations: list[float]
    value: float

    def marks(self, scale: float) -> list[bool]:
        """The active tokens: above 0 and at least ``min(scale / 10, value)``."""
        least = min(scale / 10, self.value)
        return [a > 0 and a >= least for a in self.activations]

    def rescaled(self, scale: float) -> list[int]:
        """Activations as whole numbers 0..10 (``floor(10 a / scale)``)."""
        if not scale > 0:
            return [0] * len(self.activations)
        return [min(10, max(0, math.floor(10 * a / scale))) if math.isfinite(a) else 0 for a in self.activations]


def _passage(example: Example, decode: Callable[[int], str], special: set[int]) -> _Passage:
    """The example's context decoded token by token, special ids left out, tabs and newlines escaped."""
    kept = [(t, a) for t, a in zip(example.tokens, example.activations, strict=True) if t not in special]
    tokens = [decode(int(t)).translate(_ESCAPES) for t, _ in kept]
    return _Passage(tokens, [float(a) for _, a in kept], float(example.value))


def _with_marks(tokens: Sequence[str], marked: Sequence[bool]) -> str:
    """The tokens as text, each run of marked tokens between ``<<`` and ``>>``."""
    out, inside = [], False
    for token, mark in zip(tokens, marked, strict=True):
        if mark and not inside:
            out.append("<<")
        elif inside and not mark:
            out.append(">>")
        inside = mark
        out.append(token)
    return "".join([*out, ">>"] if inside else out)


@dataclass(frozen=True)
class _Split:
    """A unit's examples: ``shown`` to the explainer; held-out ``activating`` and ``quiet`` ones for scoring."""

    shown: list[Example]
    activating: list[Example]
    quiet: list[Example]


def _draw(items: list[Example], n: int, rng: random.Random) -> list[Example]:
    """``n`` of ``items`` drawn uniformly, in their order (all of them when there are no more)."""
    if len(items) <= n:
        return list(items)
    return [items[i] for i in sorted(rng.sample(range(len(items)), n))]


def _split(report: UnitReport, index: int, examples: int, seed: int, purpose: str) -> _Split:
    """The examples of unit ``index``: even top ranks for the explainer, the rest held out (see the module doc)."""
    top = report.top(index)
    even = top[0::2]
    left, right = (int(c) for c in report.settings["context"])
    width = left + right + 1

    def clear(e: Example) -> bool:
        return not any(e.document == s.document and abs(e.position - s.position) < width for s in even)

    seen: set[tuple[int, int]] = set()
    pool: list[Example] = []
    candidates = list(top[1::2])
    if report.band_samples is not None:
        candidates += [e for band in report.bands(index, "interval") for e in band]
    for e in candidates:
        if e.value > 0 and (e.document, e.position) not in seen and clear(e):
            seen.add((e.document, e.position))
            pool.append(e)
    quiet = [e for e in report.non_activating(index) if clear(e)]
    rng = random.Random(f"hookscope.features.explain/{purpose}/{seed}/{index}")
    return _Split(
        shown=_draw([e for e in even if e.value > 0], examples, rng),
        activating=_draw(pool, examples, rng),
        quiet=_draw(quiet, examples, rng),
    )


class _Reader:
    """Passages of one report: its decoder, special ids and per-unit scale."""

    def __init__(self, report: UnitReport) -> None:
        self.report = report
        self.decode = decoder(report.tokenizer)
        self.special = {int(i) for i in report.settings.get("special_ids", [])}

    def passage(self, example: Example) -> _Passage:
        """The example as a passage."""
        return _passage(example, self.decode, self.special)

    def scale(self, index: int) -> float:
        """The unit's largest activation over the dataset (0 for a unit that saw none)."""
        m = float(self.report.max[index])
        return m if math.isfinite(m) else 0.0


def _explainer_prompt(passages: Sequence[_Passage], scale: float) -> str:
    """The explainer's prompt for these passages, activations rescaled by ``scale``."""
    blocks = []
    for i, p in enumerate(passages, 1):
        marks = p.marks(scale)
        values = p.rescaled(scale)
        listed = ", ".join(
            f'("{t}", {max(1, v)})' for t, v, m in zip(p.tokens, values, marks, strict=True) if m
        )  # fmt: skip
        blocks.append(f"Passage {i}: {_with_marks(p.tokens, marks)}\nActive tokens: {listed}")
    return EXPLAINER_PROMPT.format(passages="\n\n".join(blocks))


def parse_explanation(reply: str, *, started: bool = False) -> str:
    r"""The explanation in an explainer's reply (see the module doc); ``""`` when there is none.

    Args:
        reply: the explainer's text.
        started: the reply continues an ``Explanation:`` already written (a local model's answer).

    Example:
        >>> parse_explanation('Thinking...\nExplanation: "the token er" in comparatives.'), parse_explanation("no")
        ('"the token er" in comparatives', '')
    """
    found = list(_MARKER.finditer(reply))
    if found:
        body = reply[found[-1].end() :]
    elif started:
        body = reply
    else:
        return ""
    for line in body.splitlines():
        line = line.strip().rstrip(".").strip()
        if len(line) > 1 and line[0] == line[-1] and line[0] in "\"'`":
            line = line[1:-1].strip().rstrip(".").strip()
        if line:
            return line
    return ""
