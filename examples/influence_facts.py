"""Which training sentence taught a language model this fact? Influence on SmolLM2-135M after a short fine-tune.

SmolLM2-135M-Instruct is fine-tuned for a few steps on 48 invented one-sentence facts ("The capital of Velmora is
Tarsk."), words the model has never seen together. For each fact, a query (the sentence without its last word, the
answer's log-probability as the measurement) is scored against every training sentence by gradient similarity
(``method="identity"``) and by EK-FAC, over the down projections of the last ``--layers`` MLPs. Reported: the rank of
the fact's own sentence among the 48 for every query (1 = top proponent), and how often it is first.

Run: ``python3 examples/influence_facts.py`` (SmolLM2 offline: see ``examples/_smollm2.py``); writes
``out/influence_facts.png``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from _smollm2 import load_smollm2

from attribution.influence import InfluenceFunction

ATTRIBUTES = ["capital", "river", "poet", "coin", "festival", "mountain"]
PLACES = ["Velmora", "Quastia", "Dornel", "Ystrava", "Pellune", "Carvosk", "Menthar", "Obrisca"]
SYLLABLES = ["tar", "vek", "mol", "zin", "ush", "pra", "dol", "quen", "ris", "bo", "lat", "fen"]


def facts(count: int) -> list[tuple[str, str]]:
    """``count`` (prompt, answer) pairs: every attribute of every place, with an invented answer word."""
    pairs = list(itertools.product(PLACES, ATTRIBUTES))[:count]
    g = torch.Generator().manual_seed(0)
    rows = []
    for place, attribute in pairs:
        a, b = torch.randint(0, len(SYLLABLES), (2,), generator=g).tolist()
        rows.append((f"The {attribute} of {place} is", f" {(SYLLABLES[a] + SYLLABLES[b]).capitalize()}"))
    return rows


def batch(tokenizer: Any, rows: list[tuple[str, str]], answer_only: bool) -> dict[str, torch.Tensor]:
    """Token ids padded on the right (a causal model's real tokens never see the padding after them); labels -100
    where the loss does not count (padding, or all but the answer)."""
    encoded = [
        (tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(answer + ".", add_special_tokens=False))
        for prompt, answer in rows
    ]
    width = max(len(p) + len(a) for p, a in encoded)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id or 0)
    labels = torch.full((len(rows), width), -100)
    for i, (p, a) in enumerate(encoded):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        start = len(p) if answer_only else 1
        labels[i, start : len(p) + len(a)] = torch.tensor((p + a)[start:])
    return {"input_ids": ids, "labels": labels}


def sequence_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per example: the summed cross-entropy of the labelled tokens (each predicted from the position before)."""
    logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    return losses.sum(1)


def fine_tune(model: Any, train: dict[str, torch.Tensor], steps: int) -> None:
    """Adam on the whole model, batches of 12 sentences."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    for step in range(steps):
        rows = torch.arange(len(train["labels"])).roll(-12 * step)[:12]
        loss = sequence_loss(model(input_ids=train["input_ids"][rows]), {k: v[rows] for k, v in train.items()})
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
    model.eval()
    model.zero_grad(set_to_none=True)


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """For query ``i``, the rank (1 = the strongest proponent) of training sentence ``i``."""
    return (scores > scores.diagonal()[:, None]).sum(1) + 1


def main(out: Path, count: int = 48, steps: int = 24, layers: int = 6, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_smollm2()
    rows = facts(count)
    train = batch(tokenizer, rows, answer_only=False)
    fine_tune(model, train, steps)
    tuned = time.perf_counter() - started
    queries = batch(tokenizer, rows, answer_only=True)
    n = model.config.num_hidden_layers
    modules = [f"model.layers.{i}.mlp.down_proj" for i in range(n - layers, n)]
    for p in model.parameters():
        p.requires_grad_(False)
    for name in modules:
        model.get_submodule(name).weight.requires_grad_(True)
    chunks = [{k: v[i : i + 12] for k, v in train.items()} for i in range(0, count, 12)]
    found = {}
    for method in ("identity", "ekfac"):
        influence = InfluenceFunction(model, sequence_loss, modules, method=method, fisher="empirical")
        influence.fit(chunks)
        scores = influence.scores([{k: v[i : i + 12] for k, v in queries.items()} for i in range(0, count, 12)], chunks)
        rank = found[method] = ranks(scores)
        first, median, worst = int((rank == 1).sum()), rank.median().item(), rank.max().item()
        print(f"{method}: the fact's own sentence is the top proponent for {first} of {count} queries; median rank "
              f"{median}, worst {worst}")  # fmt: skip
    plot(out / "influence_facts.png", found, count)
    print(f"fine-tuned in {tuned:.0f} s; done in {time.perf_counter() - started:.0f} s")


def plot(path: Path, found: dict[str, torch.Tensor], count: int) -> None:
    fig, ax = plt.subplots(figsize=(7, 3))
    for offset, (method, rank) in zip((-0.2, 0.2), found.items(), strict=True):
        ax.bar(torch.arange(count) + offset, rank, width=0.4, label=method)
    ax.set_xlabel("query (one per invented fact)")
    ax.set_ylabel("rank of its own sentence\n(1 = top proponent)")
    ax.set_title(f"SmolLM2-135M fine-tuned on {count} facts: which sentence taught each one")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--facts", type=int, default=48)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    main(args.out, args.facts, args.steps, args.layers, args.threads)
