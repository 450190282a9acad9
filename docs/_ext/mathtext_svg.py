"""Render ``.. math::`` and ``:math:`` offline, as SVG drawn by matplotlib's mathtext (no LaTeX, no MathJax).

``sphinx.ext.mathjax`` loads MathJax from a CDN and ``sphinx.ext.imgmath`` needs a LaTeX installation; matplotlib
is already a dependency of the project and draws a large subset of TeX math with its bundled Computer Modern fonts.
Each formula becomes ``_images/math/<sha1>.svg`` (transparent background, glyphs as paths). A formula that mathtext
cannot parse is a Sphinx warning, so a ``-W`` build fails on it. Blank lines in a ``.. math::`` block separate
equations, each drawn on its own line, with ``\\frac`` drawn full size (``\\dfrac``).
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

_INLINE_SIZE = 12.5
_DISPLAY_SIZE = 15.0
_DEPTHS: dict[str, float] = {}  # formula key -> depth below the baseline, in points (this build)


def _render(translator: Any, latex: str, size: float) -> tuple[str, float] | None:
    """Write the SVG of ``latex`` (once per content) and return its path relative to the page, and its depth."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import mathtext
    from matplotlib.font_manager import FontProperties

    key = hashlib.sha1(f"{size}|{latex}".encode()).hexdigest()[:16]
    if key not in _DEPTHS:
        buffer = io.BytesIO()
        rc = {"mathtext.fontset": "cm", "savefig.transparent": True, "svg.hashsalt": key, "svg.fonttype": "path"}
        try:
            with matplotlib.rc_context(rc):
                depth = mathtext.math_to_image(f"${latex}$", buffer, prop=FontProperties(size=size), format="svg")
        except Exception as exc:
            logger.warning("mathtext cannot draw %r: %s", latex, str(exc).strip().splitlines()[-1])
            return None
        svg = re.sub(r"<metadata>.*?</metadata>\s*", "", buffer.getvalue().decode(), flags=re.S)
        svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg)  # the DTD's address is never fetched, but need not be there
        outdir = Path(translator.builder.outdir) / translator.builder.imagedir / "math"
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / f"{key}.svg").write_text(svg, encoding="utf-8")
        _DEPTHS[key] = float(depth)
    depth = _DEPTHS[key]
    return f"{translator.builder.imgpath}/math/{key}.svg", depth


def _alt(translator: Any, latex: str) -> str:
    return translator.encode(latex.strip()).replace('"', "&quot;")


def visit_math(translator: Any, node: nodes.math) -> None:
    latex = node.astext()
    rendered = _render(translator, latex, _INLINE_SIZE)
    if rendered is None:
        translator.body.append(f'<code class="math">{translator.encode(latex)}</code>')
    else:
        src, depth = rendered
        translator.body.append(
            f'<img class="math math-inline" src="{src}" alt="{_alt(translator, latex)}" '
            f'style="vertical-align: -{depth:.1f}pt"/>'
        )
    raise nodes.SkipNode


def visit_displaymath(translator: Any, node: nodes.math_block) -> None:
    equations = [part.strip() for part in re.split(r"\n\s*\n", node.astext()) if part.strip()]
    translator.body.append(translator.starttag(node, "div", CLASS="math math-display"))
    for latex in equations:
        latex = " ".join(line.strip() for line in latex.splitlines())
        latex = re.sub(r"\\frac(?![a-z])", r"\\dfrac", latex)  # display style: full-size fractions
        rendered = _render(translator, latex, _DISPLAY_SIZE)
        if rendered is None:
            translator.body.append(f'<pre class="math">{translator.encode(latex)}</pre>')
        else:
            translator.body.append(f'<p><img class="math" src="{rendered[0]}" alt="{_alt(translator, latex)}"/></p>')
    translator.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_html_math_renderer(
        "mathtext_svg", inline_renderers=(visit_math, None), block_renderers=(visit_displaymath, None)
    )
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
