"""The feature dashboard: one self-contained page per report, its data equal to the report's, drawn in a browser.

Tokens are chosen to break a page that does not escape (``<b>x</b>``, ``</script>``, ``&``, quotes) or that hides
whitespace (a newline, two leading spaces).
"""

from __future__ import annotations

import re
from dataclasses import replace
from urllib.parse import quote

import pytest
import torch

from attribution import SAE
from attribution._html import script_json, shade, visible
from attribution.features import Directions, Features, Neurons, UnitReport, feature_statistics
from attribution.features.dashboard import dashboard, histogram_svg
from tests.attribution.models import lm64
from tests.browser import launched, page_data

TEXT = {3: "<b>x</b>", 4: "a & b", 5: "\"q'", 6: "\n", 7: "  two", 8: "</script>"}
SHOTS = "/tmp/hookscope-dashboard.png"


def text(i: int) -> str:
    return TEXT.get(i, f" w{i}")


@pytest.fixture(scope="module")
def model():
    return lm64("llama")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 40, (16, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def report(model, tokens) -> UnitReport:
    return feature_statistics(model, tokens, Neurons(1), k=5, bands=3, samples=3, tokenizer=text, progress=False)


@pytest.fixture(scope="module")
def directions(model, tokens) -> UnitReport:
    """Four directions at the first MLP's output, the second of them zero (a dead unit); no bands."""
    vectors = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    vectors[1] = 0
    return feature_statistics(model, tokens, Directions(vectors, "model.layers.0.mlp"), k=3, bands=0, samples=2,
                              tokenizer=text, progress=False)  # fmt: skip


def _self_contained(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script src" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    assert page.count("<script>") == 1 and page.count("</script>") == 1  # a token's "</script>" stays escaped


def _same_examples(cards: list[dict], examples: list, scale: float) -> None:
    """The page's examples are the report's: place, value, tokens, and each token's shade with its sign."""
    assert len(cards) == len(examples)
    for card, example in zip(cards, examples, strict=True):
        assert (card["d"], card["p"], card["o"]) == (example.document, example.position, example.offset)
        assert card["v"] == pytest.approx(example.value, rel=1e-3)
        assert card["t"] == list(example.tokens)
        for s, a in zip(card["s"], example.activations, strict=True):
            assert s == max(-100, min(100, round(100 * a / scale)))
            assert (s > 0) == (a > scale / 200) and (s < 0) == (a < -scale / 200)


def test_the_formatting_helpers():
    assert shade([2.0, -1.0, 0.5, 9.0, -9.0, float("nan"), 0.0], 2.0) == [100, -50, 25, 100, -100, 0, 0]
    assert shade([0.25], 0.0) == [25]  # no scale: relative to 1
    assert visible(" a\tb\r\n") == "·a→b↵⏎" and visible("") == "∅" and visible("<&>") == "<&>"
    svg = histogram_svg([-1.0, 0.0, 1.0, 2.0], [2, 0, 4], width=112, height=128)
    heights = [float(h) for h in re.findall(r'<rect[^>]* height="([\d.]+)"', svg)]
    assert heights == [50.0, 0.0, 100.0]  # 128 - 28 pixels for the peak
    assert re.findall(r'fill="(#\w+)"', svg) == ["#5b8fc7", "#d9695f", "#d9695f"]  # by the bin's side of 0
    assert "no non-zero values" in histogram_svg([0.0, 1.0], [0])
    tricky = {"t": "</script><!--&'\"\u2028"}
    encoded = script_json(tricky)
    assert not set(encoded) & set("<>&\u2028") and __import__("json").loads(encoded) == tricky


def test_the_page_holds_each_units_examples_and_escaped_tokens(report, tmp_path):
    path = dashboard(report, path=tmp_path / "sub" / "dashboard.html")
    page = path.read_text(encoding="utf-8")
    _self_contained(page)
    assert "<b>x" not in page and "\\u003cb\\u003ex\\u003c/b\\u003e" in page
    data = page_data(page, "D")
    assert [card["label"] for card in data["units"]] == report.labels  # all live: in order
    shown = {int(i): t for i, t in data["V"].items()}
    assert shown == {i: visible(text(i)) for i in shown}
    assert {3, 6, 7, 8} <= {t for card in data["units"] for t in card["top"][0]["t"] + card["top"][1]["t"]}
    density, mean = report.density, report.mean
    for card in data["units"]:
        i = card["unit"]
        scale = float(report.max[i])
        assert scale > 0 and card["stats"]["max"] == pytest.approx(scale, rel=1e-5)
        assert card["stats"]["density"] == pytest.approx(float(density[i]), rel=1e-5)
        assert card["stats"]["mean"] == pytest.approx(float(mean[i]), rel=1e-5, abs=1e-12)
        _same_examples(card["top"], report.top(i), scale)
        _same_examples(card["quiet"], report.non_activating(i), scale)
        for kind in ("interval", "rank"):
            assert card["bands"][kind]["edges"] == pytest.approx(report.band_edges(i, kind), rel=1e-3)
            for cards, band in zip(card["bands"][kind]["samples"], report.bands(i, kind), strict=True):
                _same_examples(cards, band, scale)
        top, bottom = report.logit_effects(i, 10)
        assert [t for t, _ in card["logits"]["top"]] == [t for t, _ in top]
        assert [v for _, v in card["logits"]["bottom"]] == pytest.approx([v for _, v in bottom], rel=1e-3)
        assert card["neighbours"]["by"] == "cosine"
        near = report.neighbours(i, 10, "cosine")
        assert [n[0] for n in card["neighbours"]["list"]] == [report.labels[j] for j, _ in near]
        assert card["text"] == "\n".join("".join(map(text, e.tokens)) for e in report.top(i)).lower()
        assert card["hist"].count("<rect") == 40


def test_live_units_come_first_and_a_capped_page_says_so(directions, tmp_path):
    assert directions.dead == [1]
    data = page_data(dashboard(directions, path=tmp_path / "all.html").read_text(encoding="utf-8"), "D")
    assert [(c["label"], c["dead"], len(c["top"])) for c in data["units"]] == [
        ("D0", False, 3), ("D2", False, 3), ("D3", False, 3), ("D1", True, 3)]  # fmt: skip
    assert {e["v"] for e in data["units"][-1]["top"]} == {0.0}  # a dead unit's top values are its zeros
    with pytest.warns(UserWarning, match=r"showing 2 of 4 units \(live units first\)"):
        page = dashboard(directions, path=tmp_path / "two.html", max_units=2).read_text(encoding="utf-8")
    assert [c["label"] for c in page_data(page, "D")["units"]] == ["D0", "D2"]
    assert "showing 2 of 4 units (live units first); pass max_units=None" in page
    chosen = page_data(dashboard(directions, ["D3", 0, 3], tmp_path / "some.html").read_text(encoding="utf-8"), "D")
    assert [c["label"] for c in chosen["units"]] == ["D3", "D0"]
    with pytest.raises(ValueError, match="`max_units` must be an integer >= 1 or None; got 0"):
        dashboard(directions, path=tmp_path / "x.html", max_units=0)
    with pytest.raises(KeyError, match="no unit is labelled 'D9'"):
        dashboard(directions, ["D9"], tmp_path / "x.html")
    with pytest.raises(TypeError, match="`report` must be a UnitReport"):
        dashboard({"labels": []}, path=tmp_path / "x.html")  # type: ignore[arg-type]


def test_a_report_without_logits_neighbours_or_bands_renders(directions, tmp_path):
    bare = replace(directions, writes=None, logits=None)
    page = dashboard(bare, path=tmp_path / "bare.html").read_text(encoding="utf-8")
    _self_contained(page)
    for card in page_data(page, "D")["units"]:
        assert card["logits"] is None and card["neighbours"] is None and card["bands"] is None
        assert len(card["quiet"]) == len(bare.non_activating(card["unit"]))
    dead = page_data(page, "D")["units"][-1]
    assert "no non-zero values" in dead["hist"] and dead["stats"]["density"] == 0.0 and dead["stats"]["max"] == 0.0


def test_dictionary_features_list_their_neighbours_by_correlation(model, tokens, tmp_path):
    torch.manual_seed(3)
    sae = SAE(16, 12, activation="relu").double()
    report = feature_statistics(model, tokens, Features(sae, "model.layers.0.mlp"), k=2, bands=0, progress=False)
    data = page_data(dashboard(report, path=tmp_path / "sae.html").read_text(encoding="utf-8"), "D")
    card = next(c for c in data["units"] if not c["dead"])
    assert card["neighbours"]["by"] == "correlation"
    expected = report.neighbours(card["unit"], 10, "correlation")
    assert [n[0] for n in card["neighbours"]["list"]] == [report.labels[j] for j, _ in expected]
    assert [n[1] for n in card["neighbours"]["list"]] == pytest.approx([v for _, v in expected], rel=1e-3)
    assert card["logits"] is not None and [t for t, _ in card["logits"]["top"]] == [
        t for t, _ in report.logit_effects(card["unit"], 10)[0]]  # fmt: skip


# -- in a browser ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with launched() as launched_browser:
        yield launched_browser


TOKENS_SHOWN = """sel => Array.from(document.querySelectorAll(sel)).map(t => ({
  text: t.textContent, shade: Number(t.dataset.shade), colour: getComputedStyle(t).backgroundColor,
  at: t.classList.contains("at"), children: t.childElementCount}))"""


def _colour(css: str) -> str:
    """'red', 'blue' or 'none' from a computed background colour."""
    match = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(?:, ([\d.]+))?\)", css)
    assert match, css
    if match[4] is not None and float(match[4]) == 0:
        return "none"
    return {"214": "red", "31": "blue"}[match[1]]


def _shows_examples(page, selector: str, examples: list, scale: float) -> None:
    """The examples drawn under ``selector``: every token's text (visible, escaped), colour by sign, the mark."""
    shown = page.evaluate(TOKENS_SHOWN, f"{selector} .tok")
    expected = [(t, a, j == e.offset) for e in examples for j, (t, a) in enumerate(zip(e.tokens, e.activations,
                                                                                     strict=True))]  # fmt: skip
    assert len(shown) == len(expected)
    for got, (token, activation, at) in zip(shown, expected, strict=True):
        assert got["text"] == visible(text(token)) and got["children"] == 0
        assert got["at"] == at
        level = max(-100, min(100, round(100 * activation / scale)))
        assert got["shade"] == level
        assert _colour(got["colour"]) == ("red" if level > 0 else "blue" if level < 0 else "none")


@pytest.mark.slow
def test_the_dashboard_renders_searches_and_opens_units_in_a_browser(report, directions, browser, tmp_path):
    path = dashboard(report, path=tmp_path / "dashboard.html")
    page = browser.page(path.as_uri())
    assert page.inner_text("#label") == report.labels[0]
    assert page.locator("#units li").count() == len(report) and page.is_visible("#search")
    _shows_examples(page, "#top", report.top(0), float(report.max[0]))
    assert page.locator("#hist svg rect").count() == 40 and page.locator("#logits tr").count() == 20

    label = report.labels[7]
    page.goto(path.as_uri() + "#unit=" + quote(label, safe=""))
    assert page.inner_text("#label") == label and page.inner_text("#units li.selected") == label
    _shows_examples(page, "#quiet", report.non_activating(7), float(report.max[7]))
    band = report.bands(7, "rank")
    page.check("input[value=rank]")
    _shows_examples(page, "#bandlist", [e for b in reversed(band) for e in b], float(report.max[7]))
    page.locator("#units li", has_text=re.compile(r"^L1/N3$")).click()
    page.wait_for_function("document.getElementById('label').textContent === 'L1/N3'")
    assert page.evaluate("location.hash") == "#unit=L1%2FN3"

    page.fill("#search", "N1")
    assert page.locator("#units li:visible").all_inner_texts() == [f"L1/N{i}" for i in [1, *range(10, 20)]]
    wanted = [u for u in range(len(report)) if any(4 in e.tokens for e in report.top(u))]
    assert 0 < len(wanted) < len(report)
    page.fill("#search", "A & B")  # the text of token 4, in some units' top examples
    assert page.locator("#units li:visible").all_inner_texts() == [report.labels[u] for u in wanted]
    assert page.inner_text("#count") == f"{len(wanted)} of {len(report)} units"
    page.fill("#search", "")
    page.goto(path.as_uri() + "#unit=" + quote(report.labels[2], safe=""))
    page.screenshot(path=SHOTS)

    bare = dashboard(replace(directions, writes=None, logits=None), path=tmp_path / "bare.html")
    page = browser.page(bare.as_uri() + "#unit=D1")
    assert page.inner_text("#label") == "D1 (dead)"
    for section in ("#logits", "#neighbours", "#bands"):
        assert "none in this report" in page.inner_text(section)
    assert {_colour(t["colour"]) for t in page.evaluate(TOKENS_SHOWN, "#top .tok")} == {"none"}  # all zero
    assert browser.errors == []
