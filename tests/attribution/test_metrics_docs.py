"""The Python code blocks of the metrics page run, in order, in one namespace (as a reader would paste them)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt

PAGE = Path(__file__).resolve().parents[2] / "docs" / "methods" / "metrics.rst"


def code_blocks(text: str) -> list[str]:
    blocks = re.findall(r"^\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text, flags=re.MULTILINE)
    return [textwrap.dedent(block) for block in blocks]


def test_the_metrics_page_runs():
    blocks = code_blocks(PAGE.read_text())
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
    assert namespace["sanity"].stages == ["6", "2", "0"]  # as the page says
    assert namespace["gone"].scores.shape == (4, 51) and namespace["debiased"].morf.shape == (4, 3)
    plt.close("all")
