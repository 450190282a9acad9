"""Feature dashboards: one self-contained HTML page that shows what each unit of a :class:`UnitReport` does."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._html import TokenTable, example_data, rounded, script_json
from .._inputs import decoder
from .._run import warn
from ._page import PAGE
from .report import Unit, UnitReport

MAX_UNITS = 200
"""Units on one page by default: about 40 kB of page each with ``k=20``, ten bands of five samples and a context of
13 tokens (8 MB for 200 units, written in about 45 ms per unit on a busy CPU, most of it reading the examples)."""

STATISTICS = ("count", "density", "max", "min", "mean", "variance", "skewness", "kurtosis")
QUANTILES = (0.5, 0.9, 0.99)


def dashboard(
    report: UnitReport,
    units: Unit | Sequence[Unit] | None = None,
    path: str | Path = "dashboard.html",
    *,
    max_units: int | None = MAX_UNITS,
) -> Path:
    """Write one self-contained HTML page (no network) that shows what units do, searchable by unit.

    Per unit: its label and statistics (count, density, max, min, mean, variance, skewness, kurtosis, quantiles), a
    histogram of its non-zero values, its logit effects, its neighbours (by activation correlation where the report
    has co-activations, else by the cosine of the output directions), its top examples with each token shaded by the
    unit's activation (red above 0, blue below, as a share of the unit's max) and the example's token outlined, the
    band samples of both kinds (a switch) and non-activating samples. Whitespace in tokens is drawn visibly (``·``
    a space, ``⏎`` a newline, ``→`` a tab). A search box filters the units by label or by the text of their top
    examples; ``page.html#unit=LABEL`` opens one. The data is JSON inside the page, drawn by its own script.

    Args:
        report: the report of :func:`feature_statistics`; its tokenizer turns ids into text (``[id]`` without one).
        units: a unit or a list of units (numbers or labels), in the page's order; ``None``: every unit, the live
            ones first, then the dead ones.
        path: the page's file.
        max_units: at most this many units on the page (``None``: no limit); when more are chosen, the first
            ``max_units`` are shown, and the page and a warning say so.

    Returns:
        The page's path.

    Raises:
        TypeError: ``report`` is not a :class:`UnitReport`.
        ValueError: a bad ``max_units``.
        KeyError: a label the report does not have.
        IndexError: a unit number the report does not have.

    Example:
        >>> import tempfile, transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 50, (6, 12)), Neurons(1), k=3, bands=2, context=(2, 2),
        ...                             tokenizer=lambda i: f" w{i}", progress=False)
        >>> page = dashboard(report, ["L1/N0", 5], Path(tempfile.mkdtemp()) / "neurons.html")
        >>> text = page.read_text()
        >>> '"label":"L1/N5"' in text, "<script src" in text
        (True, False)
    """
    if not isinstance(report, UnitReport):
        raise TypeError(f"`report` must be a UnitReport (from feature_statistics); got {type(report).__name__}")
    chosen, note = _chosen(report, units, max_units)
    if note:
        warn(f"dashboard: {note}")
    tokens = TokenTable(decoder(report.tokenizer))
    columns = _statistics(report, chosen)
    cards = [_unit_data(report, i, tokens, {name: column[j] for name, column in columns.items()})
             for j, i in enumerate(chosen)]  # fmt: skip
    title = f"Feature dashboard: {len(chosen)} of {len(report)} units, {report.documents} documents"
    data = {"units": cards, "V": tokens.texts, "quantiles": list(QUANTILES)}
    page = (PAGE.replace("__TITLE__", html.escape(title)).replace("__NOTE__", html.escape(note))
            .replace("__DATA__", script_json(data)))  # fmt: skip
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def _chosen(report: UnitReport, units: Unit | Sequence[Unit] | None, max_units: int | None) -> tuple[list[int], str]:
    """The units' numbers in page order (each once), and a note when ``max_units`` left some out ('' otherwise).

    Example:
        >>> from types import SimpleNamespace
        >>> fake = SimpleNamespace(dead=[0, 2], labels=["a", "b", "c", "d"], index=lambda u: u)
        >>> _chosen(fake, None, 3)
        ([1, 3, 0], 'showing 3 of 4 units (live units first); pass max_units=None, or choose units=, for the others')
    """
    if max_units is not None and (not isinstance(max_units, int) or isinstance(max_units, bool) or max_units < 1):
        raise ValueError(f"`max_units` must be an integer >= 1 or None; got {max_units!r}")
    if units is None:
        dead = set(report.dead)
        order = [i for i in range(len(report.labels)) if i not in dead] + sorted(dead)
    elif isinstance(units, (int, str)):
        order = [report.index(units)]
    else:
        order = list(dict.fromkeys(report.index(u) for u in units))
    if max_units is None or len(order) <= max_units:
        return order, ""
    first = " (live units first)" if units is None else ""
    note = (f"showing {max_units} of {len(order)} units{first}; pass max_units=None, or choose units=, for the "
            "others")  # fmt: skip
    return order[:max_units], note


def _scale(report: UnitReport, unit: int) -> float:
    """What a unit's shading is relative to: its max, or ``|min|`` where the max is not above 0 (1 for none)."""
    high, low = float(report.max[unit]), float(report.min[unit])
    if high > 0:
        return high
    return -low if low < 0 else 1.0


def unit_card(report: UnitReport, unit: Unit, tokens: TokenTable, *, examples: int | None = None,
              logits: int = 10) -> dict[str, Any]:  # fmt: skip
    """A unit's summary as page data: label, number, density, max, top examples and logit effects.

    Args:
        report: the report.
        unit: the unit (number or label).
        tokens: the page's token texts (the examples' and logits' ids are added).
        examples: how many top examples (``None``: all kept).
        logits: how many top and bottom logit effects (``logits`` is ``None`` where the report has none).
    """
    i = report.index(unit)
    scale = _scale(report, i)
    top = report.top(i)[:examples]
    return {
        "label": report.labels[i],
        "unit": i,
        "density": rounded(float(report.density[i])),
        "max": rounded(float(report.max[i])),
        "scale": rounded(scale),
        "top": [example_data(e, scale, tokens) for e in top],
        "logits": _logits(report, i, tokens, logits),
    }


def _logits(report: UnitReport, i: int, tokens: TokenTable, k: int) -> dict[str, list[list[Any]]] | None:
    """``{"top": [[id, value], ...], "bottom": ...}`` or ``None`` where the report has no logit effects."""
    if report.logits is None:
        return None
    top, bottom = report.logit_effects(i, min(k, report.logits["top_ids"].shape[1]))
    return {name: [[tokens.add(t), rounded(v)] for t, v in pairs] for name, pairs in (("top", top), ("bottom", bottom))}


def _statistics(report: UnitReport, chosen: list[int]) -> dict[str, list[float | None]]:
    """Each statistic's column over the chosen units, read once (the moments are computed once for all)."""
    index = torch.tensor(chosen, dtype=torch.long)
    columns = {name: getattr(report, name) for name in STATISTICS}
    quantiles = report.quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    for j, q in enumerate(QUANTILES):
        columns[f"q{q:g}"] = quantiles[:, j]
    columns["quantile error"] = report.quantile_error
    return {name: [rounded(float(v), 6) for v in column[index].tolist()] for name, column in columns.items()}


def _unit_data(report: UnitReport, i: int, tokens: TokenTable, stats: dict[str, float | None]) -> dict[str, Any]:
    """Everything the dashboard shows of one unit."""
    card = unit_card(report, i, tokens)
    scale = _scale(report, i)
    card.update(
        stats=stats,
        dead=i in set(report.dead),
        hist=histogram_svg(*report.histogram(i)),
        bands=_bands(report, i, scale, tokens),
        quiet=[example_data(e, scale, tokens) for e in report.non_activating(i)],
        neighbours=_neighbours(report, i),
        text="\n".join(tokens.text(e["t"]) for e in card["top"]).lower(),
    )
    return card


def _bands(report: UnitReport, i: int, scale: float, tokens: TokenTable) -> dict[str, Any] | None:
    """Both kinds of band samples with their edges (``None`` for a report without bands)."""
    if report.band_samples is None:
        return None
    out = {}
    for kind in ("interval", "rank"):
        samples = report.bands(i, kind)
        edges = [rounded(e) for e in report.band_edges(i, kind)]
        out[kind] = {"edges": edges, "samples": [[example_data(e, scale, tokens) for e in band] for band in samples]}
    return out


def _neighbours(report: UnitReport, i: int, k: int = 10) -> dict[str, Any] | None:
    """The unit's neighbours by correlation where the report has co-activations, else by cosine, else ``None``."""
    for by in ("correlation", "cosine"):
        try:
            found = report.neighbours(i, k, by=by)
        except ValueError:
            continue
        return {"by": by, "list": [[report.labels[j], rounded(v)] for j, v in found]}
    return None


def histogram_svg(edges: Any, counts: Any, *, width: int = 360, height: int = 120) -> str:
    """An inline SVG histogram: one bar per bin (red for bins above 0, blue below), range and peak count labelled.

    Example:
        >>> svg = histogram_svg([-1.0, 0.0, 1.0, 2.0], [1, 0, 3])
        >>> svg.count("<rect"), 'fill="#5b8fc7"' in svg, "(1, 2]: 3" in svg
        (3, True, True)
    """
    edges, counts = [float(e) for e in edges], [int(c) for c in counts]
    top, plot = max(counts, default=0), height - 28
    head = f'<svg class="hist" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    if top == 0:
        return f'{head}<text x="8" y="{height // 2}">no non-zero values</text></svg>'
    bar = (width - 12) / len(counts)
    parts = [head]
    for j, c in enumerate(counts):
        lo, hi = edges[j], edges[j + 1]
        h = plot * c / top
        colour = "#d9695f" if lo + hi > 0 else "#5b8fc7"
        parts.append(f'<rect x="{6 + j * bar:.1f}" y="{4 + plot - h:.1f}" width="{max(bar - 1, 0.5):.1f}" '
                     f'height="{h:.1f}" fill="{colour}"><title>({lo:.4g}, {hi:.4g}]: {c}</title></rect>')  # fmt: skip
    y = height - 8
    parts.append(f'<text x="6" y="{y}">{edges[0]:.3g}</text>')
    parts.append(f'<text x="{width - 6}" y="{y}" text-anchor="end">{edges[-1]:.3g}</text>')
    parts.append(f'<text x="{width - 6}" y="14" text-anchor="end">peak {top}</text></svg>')
    return "".join(parts)
