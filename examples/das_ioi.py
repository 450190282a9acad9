"""DAS on SmolLM2-135M: where does the model keep "is the indirect object the first name or the second"?

On indirect-object-identification prompts (``When A and B went to the store, S gave a drink to``, the answer the
name that is not repeated), the variable is the indirect object's position among the two names (first: ABBA,
second: BABA). An interchange intervention takes it from a source prompt with other names: where the source's
indirect object is in the other position, a model that reads the variable from the intervened subspace answers the
base's *other* name (the counterfactual label). For every layer's residual stream, at the last position and at the
repeated name (S2), the sweep trains a 1-D DAS rotation and reports its held-out interchange intervention accuracy
(IIA), beside plain patching of the whole vector there (``k="all"``), no intervention (``k=0``, the floor) and a
linear probe's accuracy for the same variable at the same site. A probe can read the variable where the model does
not use it; DAS finds where a single direction carries it into the answer.

Run: ``python3 examples/das_ioi.py`` (SmolLM2 offline: see ``examples/_smollm2.py``); writes ``out/das_ioi.png``.
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
from _smollm2 import PAIRS, TEMPLATE, load_smollm2

from attribution import InterventionSweep, Site, intervention_sweep, probe


def names_and_tokens(tokenizer: Any) -> tuple[list[str], dict[str, int]]:
    """The 20 names of the IOI pairs and their single token ids (with the leading space)."""
    names = sorted({name for pair in PAIRS for name in pair})
    tokens = {}
    for name in names:
        (single,) = tokenizer.encode(f" {name}", add_special_tokens=False)
        tokens[name] = int(single)
    return names, tokens


def pairs(tokenizer: Any, count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` (base, source) prompt pairs with the counterfactual label, the probe's label and S2's position.

    The source's four names are drawn apart from the base's, its order at random; the label is the base's name at
    the source's indirect-object position (the base's own answer where the orders agree, its subject otherwise).
    """
    names, tokens = names_and_tokens(tokenizer)
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list[Any]] = {"base": [], "source": [], "label": [], "first": [], "answer": [], "subject": []}
    for _ in range(count):
        a, b, c, d = (names[i] for i in torch.randperm(len(names), generator=g)[:4].tolist())
        base_first, source_first = bool(torch.rand(1, generator=g) < 0.5), bool(torch.rand(1, generator=g) < 0.5)
        base_io, base_s = a, b
        order = (base_io, base_s) if base_first else (base_s, base_io)
        rows["base"].append(TEMPLATE.format(a=f" {order[0]}", b=f" {order[1]}", s=f" {base_s}"))
        source = (c, d) if source_first else (d, c)  # c is the source's indirect object
        rows["source"].append(TEMPLATE.format(a=f" {source[0]}", b=f" {source[1]}", s=f" {d}"))
        rows["label"].append(tokens[order[0] if source_first else order[1]])
        rows["first"].append(int(base_first))
        rows["answer"].append(tokens[base_io])
        rows["subject"].append(tokens[base_s])
    encoded = {key: encode(tokenizer, rows[key]) for key in ("base", "source")}
    return {**encoded, **{key: torch.tensor(rows[key]) for key in ("label", "first", "answer", "subject")}}


def encode(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """Token ids ``(n, T)``; every prompt has the same length (single-token names)."""
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    if len({len(row) for row in ids}) != 1:
        raise ValueError("the prompts tokenise to different lengths: choose single-token names")
    return torch.tensor(ids)


def main(out: Path, count: int = 256, every: int = 3, epochs: int = 4, threads: int = 2) -> InterventionSweep:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_smollm2()
    train, test = pairs(tokenizer, count, seed=0), pairs(tokenizer, max(count // 2, 16), seed=1)
    with torch.no_grad():
        logits = model(test["base"], use_cache=False, logits_to_keep=1).logits[:, -1]
    correct = float((logits.argmax(-1) == test["answer"]).double().mean())
    length = train["base"].shape[1]
    s2 = length - 5  # ",{s} gave a drink to": the subject's repeat is the fifth token from the end
    assert bool((train["base"][:, s2] == train["subject"]).all()), "S2 is not where the template puts it"
    layers = list(range(0, model.config.num_hidden_layers, every))
    where_at = {"END": -1, "S2": s2}
    sites = {f"{i} {w}": Site(f"model.layers.{i}", positions=[p]) for i in layers for w, p in where_at.items()}
    triples = [(d["base"], d["source"], d["label"]) for d in (train, test)]
    sweep = intervention_sweep(model, *triples, sites, ks=[0, 1, "all"], epochs=epochs, lr=1e-2, batch_size=32)
    took = time.perf_counter() - started
    print(f"{count} training and {len(test['label'])} held-out pairs of {length} tokens; the model answers "
          f"{correct:.0%} of the held-out bases; {len(sites)} sites x 3 sizes in {took:.0f} s")  # fmt: skip

    inputs = {"input_ids": torch.cat([train["base"], test["base"]]), "use_cache": False, "logits_to_keep": 1}
    labels = torch.cat([train["first"], test["first"]])
    names = [f"model.layers.{i}" for i in layers]
    probes = {w: probe(model, inputs, labels, names, position=p, batch_size=64) for w, p in where_at.items()}
    print("| layer | site | no intervention | DAS k=1 | patch all | probe accuracy |")
    print("|---:|---|---:|---:|---:|---:|")
    for i in layers:
        for where in ("END", "S2"):
            row = sweep.iia[list(sites).index(f"{i} {where}")].tolist()
            accuracy = probes[where].accuracy[f"model.layers.{i}"]
            print(f"| {i} | {where} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {accuracy:.2f} |")
    best = sweep.best()
    print(f"best: layer {best[0]}, k={best[1]}: IIA {best[2]:.2f}")
    draw(sweep, probes, layers, out / "das_ioi.png")
    print(f"wrote {out}/das_ioi.png in {time.perf_counter() - started:.0f} s")
    return sweep


def draw(sweep: InterventionSweep, probes: dict[str, Any], layers: list[int], path: Path) -> None:
    """Per site a panel: IIA of 1-D DAS, of whole-vector patching and of no intervention, and the probe, by layer."""
    fig, panels = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True, constrained_layout=True)
    labels = sweep.iia.labels["site"]
    for ax, where in zip(panels, ("END", "S2"), strict=True):
        rows = [labels.index(f"{i} {where}") for i in layers]
        values = sweep.iia.as_subclass(torch.Tensor)[rows]
        ax.plot(layers, values[:, 1], "o-", color="tab:red", label="DAS, one direction (IIA)")
        ax.plot(layers, values[:, 2], "s--", color="tab:orange", label="patch the whole vector (IIA)")
        ax.plot(layers, values[:, 0], ":", color="gray", label="no intervention (IIA)")
        accuracy = [probes[where].accuracy[f"model.layers.{i}"] for i in layers]
        ax.plot(layers, accuracy, "^-", color="tab:blue", label="linear probe (accuracy)")
        ax.set_title(f"{'last position' if where == 'END' else 'repeated name (S2)'}", fontsize=10)
        ax.set_xlabel("layer (residual stream after it)", fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
    panels[0].set_ylabel("held-out accuracy", fontsize=10)
    panels[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("SmolLM2-135M, IOI: is the indirect object the first name or the second?", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--pairs", type=int, default=256, help="training pairs (held out: half as many)")
    parser.add_argument("--every", type=int, default=3, help="every n-th layer")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main(args.out, args.pairs, args.every, args.epochs, threads=args.threads)
