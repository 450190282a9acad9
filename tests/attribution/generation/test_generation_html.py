"""The HTML view of attribute_generation: self-contained, and it really shows the hovered token's row (in a browser)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from attribution.generation import GenerationAttribution

SCORES = torch.tensor([
    [0.5, -1.0, 0.25, 0.0, 0.0, 0.0],
    [-0.2, 0.1, 0.4, 0.8, 0.0, 0.0],
    [0.3, 0.3, -0.6, 0.05, -0.9, 0.0],
])  # fmt: skip
RESULT = GenerationAttribution(SCORES, torch.tensor([7, 8, 9]), torch.tensor([3, 4, 5, 7, 8, 9]), 3, "saliency", None)


def test_the_page_is_self_contained_and_escapes_tokens(tmp_path):
    page = RESULT.to_html(tmp_path / "page.html", tokenizer=lambda i: f"<b>{i}</b>&")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == page
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)
    assert "@import" not in page and "url(" not in page and "<link" not in page
    assert "&lt;b&gt;7&lt;/b&gt;&amp;" in page and "<b>7" not in page
    assert page.count('class="tok gen"') == 3 and page.count('class="tok prompt"') == 3


def _browser() -> str:
    for name in ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name) or shutil.which(name, path="/usr/lib/chromium")
        if found:
            return found
    pytest.skip("no headless chromium installed (Debian: apt-get install chromium-headless-shell)")


def _dom(path, fragment: str = "") -> list[dict[str, str]]:
    """The token spans of the page after its script ran, as the browser left them."""
    command = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"file://{path}{fragment}"]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    spans = []
    for kind, attributes in re.findall(r'<span class="tok ([^"]*)"([^>]*)>', dom):
        spans.append({"class": kind, **dict(re.findall(r'([\w-]+)="([^"]*)"', attributes))})
    return spans


def _alpha_and_colour(style: str) -> tuple[str, float]:
    match = re.search(r"rgba?\((\d+), (\d+), (\d+)(?:, ([\d.]+))?\)", style)
    assert match, style
    colour = "red" if match[1] == "214" else "blue"
    return colour, float(match[4]) if match[4] is not None else 1.0


def test_hovering_a_generated_token_shows_its_row_in_a_browser(tmp_path):
    path = tmp_path / "page.html"
    RESULT.to_html(path)
    spans = _dom(path, "#row=2")  # the page hovers generated token 2 itself (a mouseover event on it)
    assert len(spans) == 6
    row = SCORES[2]
    for j, span in enumerate(spans):
        assert float(span["data-value"]) == pytest.approx(float(row[j]))
        colour, alpha = _alpha_and_colour(span["style"])
        assert alpha == pytest.approx(abs(float(row[j])) / 0.9, abs=1e-3)
        if row[j] != 0:
            assert colour == ("red" if row[j] > 0 else "blue")
    assert [s["class"] for s in spans].count("gen selected") == 1 and spans[5]["class"] == "gen selected"

    overview = _dom(path)  # before any hover: the sum of the rows
    for j, span in enumerate(overview):
        assert float(span["data-value"]) == pytest.approx(float(SCORES[:, j].sum()), abs=1e-6)
    assert not any("selected" in s["class"] for s in overview)
