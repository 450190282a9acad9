"""The result of :func:`attribution.attribute_generation`, with a heatmap and a self-contained HTML view."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._inputs import decoder

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass
class GenerationAttribution:
    """Each generated token's attribution to the tokens before it (``B`` leads every field for several prompts)."""

    scores: torch.Tensor
    """``(N, P + N)``: row ``i`` is generated token ``i``'s attribution to each input position, zero from ``P + i``."""
    generated: torch.Tensor
    """``(N,)`` the generated token ids."""
    tokens: torch.Tensor
    """``(P + N,)`` the prompt's ids followed by the generated ones."""
    prompt_len: int
    """``P``."""
    method: str
    per_dimension: torch.Tensor | None
    """``(N, P + N, hidden)`` before the sum over the hidden size, when asked for."""

    def _example(self, example: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scores.dim() == 3:
            return self.scores[example], self.tokens[example]
        if example != 0:
            raise IndexError(f"`example`={example}, but the result holds one sequence")
        return self.scores, self.tokens

    def plot(
        self, *, tokenizer: Any = None, example: int = 0, ax: Axes | None = None, title: str | None = None
    ) -> Axes:
        """The matrix as a heatmap: generated tokens down, input positions across (red: towards, blue: against).

        Args:
            tokenizer: a tokenizer (its ``decode``) or a function from a token id to its text, for the labels.
            example: which sequence, for a result of several.
            ax: the axes to draw on (else a new figure).
            title: the title.

        Returns:
            The axes.
        """
        import matplotlib.pyplot as plt

        scores, tokens = self._example(example)
        text = decoder(tokenizer)
        labels = [text(int(t)).replace("\n", "\\n") for t in tokens]
        n, width = scores.shape
        if ax is None:
            _, ax = plt.subplots(figsize=(max(5.0, 0.2 * width + 2), max(3.0, 0.2 * n + 1.5)))
        values = scores.detach().float().cpu()
        limit = max(float(values.abs().max()), 1e-12)
        image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        ax.axvline(self.prompt_len - 0.5, color="black", linewidth=0.8)
        ax.set_xticks(range(width), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n), labels[self.prompt_len :], fontsize=7)
        ax.set_xlabel("input position (prompt | generated)")
        ax.set_ylabel("generated token")
        ax.figure.colorbar(image, ax=ax, fraction=0.03, label=self.method)
        ax.set_title(title or f"attribution of each generated token ({self.method})")
        return ax

    def to_html(self, path: str | Path | None = None, *, tokenizer: Any = None, example: int = 0) -> str:
        """One self-contained HTML page: the text with background colours; hover a generated token to see its row.

        The page has no external scripts, styles or fonts. Red is attribution towards the hovered token, blue
        against, each row scaled by its largest magnitude; before any hover, the colours show the sum of all rows.
        ``page.html#row=3`` opens with generated token 3 selected.

        Args:
            path: where to write the page (also returned as a string).
            tokenizer: a tokenizer (its ``decode``) or a function from a token id to its text.
            example: which sequence, for a result of several.

        Returns:
            The page.

        Example:
            >>> result = GenerationAttribution(torch.tensor([[0.5, -1.0, 0.0]]), torch.tensor([7]),
            ...     torch.tensor([3, 4, 7]), 2, "saliency", None)
            >>> page = result.to_html(tokenizer=lambda i: f"<{i}>")
            >>> "&lt;7&gt;" in page, "<script src" in page
            (True, False)
        """
        scores, tokens = self._example(example)
        text = decoder(tokenizer)
        spans = []
        for j, token in enumerate(tokens.tolist()):
            kind = "prompt" if j < self.prompt_len else "gen"
            row = f' data-row="{j - self.prompt_len}"' if kind == "gen" else ""
            spans.append(f'<span class="tok {kind}" data-col="{j}"{row}>{html.escape(text(token))}</span>')
        data = json.dumps([[round(float(v), 6) for v in r] for r in scores.detach().float().cpu()])
        page = _PAGE.format(method=html.escape(self.method), spans="".join(spans), data=data, prompt=self.prompt_len)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Attribution of generated text ({method})</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 60em; line-height: 2; }}
#text {{ white-space: pre-wrap; font-family: monospace; font-size: 15px; }}
.tok {{ padding: 2px 0; border-radius: 3px; }}
.gen {{ cursor: pointer; text-decoration: underline dotted; }}
.gen.selected {{ outline: 2px solid #222; }}
.hint {{ color: #555; font-size: 13px; }}
#info {{ font-family: monospace; font-size: 13px; color: #333; min-height: 1.5em; }}
</style></head>
<body>
<h3>Attribution of each generated token ({method})</h3>
<p class="hint">Hover a generated (underlined) token: the colours show its attribution to every token before it
(red: towards it, blue: against, scaled by the row's largest magnitude). Before any hover: the sum of all rows.</p>
<div id="text">{spans}</div>
<div id="info"></div>
<script>
const S = {data};
const P = {prompt};
const spans = Array.from(document.querySelectorAll("#text .tok"));
function colour(v) {{
  const a = Math.min(1, Math.abs(v)).toFixed(3);
  return v >= 0 ? "rgba(214, 39, 40, " + a + ")" : "rgba(31, 119, 180, " + a + ")";
}}
function paint(values, selected) {{
  const top = Math.max(1e-12, ...values.map(Math.abs));
  spans.forEach((s, j) => {{
    s.style.backgroundColor = colour(values[j] / top);
    s.dataset.value = values[j];
    s.classList.toggle("selected", j === selected);
  }});
}}
function show(row) {{
  paint(S[row], P + row);
  document.getElementById("info").textContent = "generated token " + row + ": largest |attribution| " +
    Math.max(...S[row].map(Math.abs)).toPrecision(3);
}}
function overview() {{
  const sum = S[0].map((_, j) => S.reduce((acc, r) => acc + r[j], 0));
  paint(sum, -1);
  document.getElementById("info").textContent = "sum over the " + S.length + " generated tokens";
}}
spans.filter(s => s.classList.contains("gen")).forEach(s => {{
  s.addEventListener("mouseover", () => show(Number(s.dataset.row)));
}});
document.getElementById("text").addEventListener("mouseleave", overview);
overview();
const wanted = /row=(\\d+)/.exec(location.hash);
if (wanted) {{
  const target = spans.find(s => s.dataset.row === wanted[1]);
  if (target) target.dispatchEvent(new MouseEvent("mouseover", {{bubbles: true}}));
}}
</script>
</body></html>
"""
