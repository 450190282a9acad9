"""Draws docs/gallery/attnlrp_smollm2.png: AttnLRP token relevance of SmolLM2-135M-Instruct on an IOI sentence.

Run from the repository root: python docs/_tools/make_attnlrp.py
The logit explained is that of the indirect object (" Mary") at the last position. Red: for it, blue: against;
colours are scaled to the largest absolute relevance, with 0 white.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from _smollm2 import load_smollm2  # noqa: E402

from attribution import AttnLRP  # noqa: E402
from attribution.plot import show_tokens  # noqa: E402

SENTENCE = "When Mary and John went to the store, John gave a drink to"
ANSWER = " Mary"


def main() -> None:
    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    ids = tokenizer(SENTENCE, return_tensors="pt")["input_ids"]
    target = tokenizer(ANSWER, add_special_tokens=False)["input_ids"][0]
    result = AttnLRP(model).attribute(ids, target=target)
    relevance = result.relevance[0]
    tokens = [tokenizer.decode([int(t)]) for t in ids[0]]
    scale = float(relevance.abs().max())
    fig, ax = plt.subplots(figsize=(10, 1.6))
    show_tokens(tokens, relevance / (2 * scale) + 0.5, ax=ax, cmap="bwr", normalize=False, per_line=16)
    ax.set_title(
        f"AttnLRP, SmolLM2-135M: relevance for the next token {ANSWER!r} (logit {float(result.logits[0]):.2f}, "
        f"summed relevance {float(relevance.sum()):.2f})",
        fontsize=9,
    )
    out = ROOT / "docs" / "gallery" / "attnlrp_smollm2.png"
    fig.savefig(out, dpi=90, bbox_inches="tight")
    plt.close(fig)
    for token, value in zip(tokens, relevance.tolist(), strict=True):
        print(f"{token!r:>12} {value:+.3f}")
    print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
