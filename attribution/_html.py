"""What the self-contained HTML pages (feature dashboards, the graph viewer) share.

Token text made visible, shading, examples as page data, data embedded safely in a ``<script>``, and the script and
style that draw an example. Pages carry their data as JSON and draw it with ``textContent`` (never ``innerHTML`` of
text), so a token's text cannot become markup; :func:`script_json` keeps the JSON itself from closing its
``<script>``.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any, Protocol

SHOWN = {"\n": "⏎", "\t": "→", "\r": "↵", " ": "·"}
"""How whitespace is drawn (circuit-tracer's arrows for newlines, tabs and returns; a middle dot for a space)."""


def visible(text: str) -> str:
    r"""``text`` with its whitespace and control characters drawn visibly (an empty text as ``∅``).

    Example:
        >>> visible(" a\tb\n"), visible(""), visible("\x07\u00a0")
        ('·a→b⏎', '∅', '\\x07·')
    """
    if not text:
        return "∅"
    out = []
    for c in text:
        if c in SHOWN:
            out.append(SHOWN[c])
        elif c.isspace():
            out.append("·")
        elif unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            out.append(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def shade(values: Iterable[float], scale: float) -> list[int]:
    """Each value as a signed percentage of ``scale``, cut to ``[-100, 100]`` (NaN: 0); drawn red above 0, blue below.

    Example:
        >>> shade([2.0, -1.0, 0.5, 9.0, float("nan")], 2.0)
        [100, -50, 25, 100, 0]
    """
    scale = scale if math.isfinite(scale) and scale > 0 else 1.0
    return [0 if not math.isfinite(v) else max(-100, min(100, round(100 * v / scale))) for v in values]


def rounded(x: float, digits: int = 4) -> float | None:
    """``x`` to ``digits`` significant digits for a page (``None`` for NaN and infinities, which JSON lacks).

    Example:
        >>> rounded(3.14159), rounded(float("-inf")), rounded(-0.000123456)
        (3.142, None, -0.0001235)
    """
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def script_json(data: Any, *, compact: bool = True) -> str:
    r"""``data`` as JSON that is safe inside ``<script>``: ``<``, ``>`` and ``&`` as ``\u`` escapes, ASCII only.

    ``compact``: no spaces after separators (else ``", "`` and ``": "``, as :func:`json.dumps` writes by default).

    Example:
        >>> script_json({"t": "</script>&"})
        '{"t":"\\u003c/script\\u003e\\u0026"}'
    """
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(data, separators=separators, ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class TokenTable:
    r"""The visible text of each token id a page uses, decoded once: the page's ``V`` (``{id: text}``).

    Example:
        >>> table = TokenTable(lambda i: f" t{i}\n")
        >>> table.add(5), table.add(5), table.texts, table.text([5, 5])
        (5, 5, {5: '·t5⏎'}, ' t5\n t5\n')
    """

    def __init__(self, decode: Callable[[int], str]) -> None:
        self._decode = decode
        self._raw: dict[int, str] = {}
        self.texts: dict[int, str] = {}

    def add(self, token: int) -> int:
        """The id, its text kept."""
        token = int(token)
        if token not in self.texts:
            self._raw[token] = self._decode(token)
            self.texts[token] = visible(self._raw[token])
        return token

    def text(self, ids: Iterable[int]) -> str:
        """The ids' text as decoded (whitespace as it is)."""
        return "".join(self._raw[self.add(t)] for t in ids)


class _Example(Protocol):
    """What :func:`example_data` reads of an example (:class:`attribution.features.Example`)."""

    @property
    def document(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def value(self) -> float: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...
    @property
    def activations(self) -> tuple[float, ...]: ...
    @property
    def offset(self) -> int: ...


def example_data(example: _Example, scale: float, tokens: TokenTable) -> dict[str, Any]:
    """One example as page data, drawn by :data:`EXAMPLE_SCRIPT`'s ``exampleRow``.

    ``d`` document, ``p`` position, ``v`` value, ``o`` the example's place in ``t``, ``t`` the context's token ids,
    ``s`` their shades (:func:`shade` of the activations by ``scale``), ``a`` the activations.
    """
    return {
        "d": int(example.document),
        "p": int(example.position),
        "v": rounded(example.value),
        "o": int(example.offset),
        "t": [tokens.add(t) for t in example.tokens],
        "s": shade(example.activations, scale),
        "a": [rounded(a, 3) for a in example.activations],
    }


EXAMPLE_STYLE = """
.ex { font-family: monospace; font-size: 13px; margin: 2px 0; line-height: 1.7; }
.ex .head { display: inline-block; min-width: 11em; margin-right: 0.5em; color: #555; white-space: pre; }
.tok { white-space: pre; padding: 1px 0; border-radius: 2px; }
.tok.at { outline: 1.5px solid #111; font-weight: bold; }
.ex .ctx { display: inline-flex; flex-wrap: wrap; gap: 2px 1px; max-width: 100%; }
.up { color: #b03a2e; } .down { color: #1f5f94; }
"""
"""The style of the examples drawn by :data:`EXAMPLE_SCRIPT`."""

EXAMPLE_SCRIPT = """
function shadeColour(s) {
  const a = (Math.min(100, Math.abs(s)) / 100).toFixed(2);
  return s > 0 ? "rgba(214, 39, 40, " + a + ")" : "rgba(31, 119, 180, " + a + ")";
}
function number(x) { return x === null || x === undefined ? "n/a" : Number(x).toPrecision(4); }
function element(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function tokenSpan(V, id, s, value, at) {
  const t = element("span", at ? "tok at" : "tok", V[id]);
  if (s) t.style.backgroundColor = shadeColour(s);
  t.dataset.shade = s; t.dataset.value = value === null ? "" : value;
  t.title = "token " + id + ": " + number(value);
  return t;
}
function exampleRow(V, ex) {
  const row = element("div", "ex");
  row.appendChild(element("span", "head", number(ex.v) + "  doc " + ex.d + " pos " + ex.p));
  const context = element("span", "ctx");
  ex.t.forEach((id, j) => context.appendChild(tokenSpan(V, id, ex.s[j], ex.a[j], j === ex.o)));
  row.appendChild(context);
  return row;
}
function logitRows(V, pairs, cls) {
  const table = element("table", "logits " + cls);
  pairs.forEach(([id, value]) => {
    const tr = element("tr");
    tr.appendChild(element("td", "tok", V[id])); tr.appendChild(element("td", cls, number(value)));
    table.appendChild(tr);
  });
  return table;
}
"""
"""``shadeColour``, ``exampleRow(V, example)`` (a row: value, document and position, then the context's tokens shaded
red/blue, the example's token outlined) and ``logitRows(V, [[id, value], ...], cls)``; ``V`` the token texts."""
