"""Probes on SmolLM2-135M: where can "which name came first" be read, and where does the model use it?

On indirect-object-identification prompts (``When A and B went to the store, S gave a drink to``, the answer the name
that is not repeated), a linear probe at the last position of every layer's residual stream is trained to say
whether the indirect object is the first name (ABBA) or the second (BABA), beside its control task (each indirect
object's name gets one random label, so a probe that memorises names scores as well there). For every layer,
``causal_check`` then ablates the probe's direction at the last position and measures the change of the model's
own logit difference (indirect object minus subject); and steers the ABBA prompts by the probe's gap towards BABA.
A layer where the probe is accurate and the intervention changes nothing holds the information without the model
reading it from there.

Run: ``python3 examples/probes_ioi.py`` (SmolLM2 offline: see ``examples/_smollm2.py``); writes
``out/probes_ioi.png``.
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
from _smollm2 import PAIRS, TEMPLATE, load_smollm2

from attribution import causal_check, probe


def prompts(tokenizer: Any, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` IOI prompts drawn from every ordered pair of the 20 names in both orders, and per prompt the
    indirect object's and the subject's token ids and the label (1: the indirect object is the first name)."""
    names = sorted({name for pair in PAIRS for name in pair})
    rows = []
    for io, s in itertools.permutations(names, 2):
        for first, second in ((io, s), (s, io)):
            text = TEMPLATE.format(a=f" {first}", b=f" {second}", s=f" {s}")
            rows.append((tokenizer.encode(text, add_special_tokens=False), io, s, int(first == io)))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:count]
    chosen = [rows[i] for i in order]

    def token(name: str) -> int:
        (single,) = tokenizer.encode(f" {name}", add_special_tokens=False)
        return int(single)

    ids = torch.tensor([r[0] for r in chosen])
    io = torch.tensor([token(r[1]) for r in chosen])
    s = torch.tensor([token(r[2]) for r in chosen])
    return ids, io, s, torch.tensor([r[3] for r in chosen])


def logit_diff(io: torch.Tensor, s: torch.Tensor) -> Any:
    """The metric: per prompt, the last position's logit of the indirect object minus the subject's."""

    def metric(output: Any) -> torch.Tensor:
        logits = output.logits[:, -1]
        rows = torch.arange(len(io))
        return logits[rows, io] - logits[rows, s]

    return metric


def main(out: Path, count: int = 400, checked: int = 80, threads: int = 2, every: int = 1) -> None:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_smollm2()
    ids, io, s, labels = prompts(tokenizer, count, seed=0)
    inputs = {"input_ids": ids, "use_cache": False, "logits_to_keep": 1}
    layers = [f"model.layers.{i}" for i in range(0, model.config.num_hidden_layers, every)]

    result = probe(model, inputs, labels, layers, position=-1, control_keys=io, batch_size=100)
    took = time.perf_counter() - started
    print(f"{count} IOI prompts, probes at the last position of {len(layers)} layers in {took:.0f} s")

    part = {"input_ids": ids[:checked], "use_cache": False, "logits_to_keep": 1}
    abba = torch.nonzero(labels == 1)[: max(1, checked // 2), 0]  # prompts whose indirect object comes first
    first = {"input_ids": ids[abba], "use_cache": False, "logits_to_keep": 1}
    metric, abba_metric = logit_diff(io[:checked], s[:checked]), logit_diff(io[abba], s[abba])
    with torch.no_grad():
        clean = float(metric(model(**part)).mean())
        clean_abba = float(abba_metric(model(**first)).mean())
    ablated, steered = [], []
    for layer in layers:
        ablated.append(causal_check(model, result, layer, part, metric, batch_size=checked, clean=clean))
        step = -result.gap[layer]  # from the ABBA mean to the BABA mean along the direction
        steered.append(
            causal_check(model, result, layer, first, abba_metric, how="steer", scale=step, clean=clean_abba)
        )
    print(
        f"clean logit difference {clean:.2f} (mean over {checked} prompts); causal checks in "
        f"{time.perf_counter() - started - took:.0f} s"
    )
    print("| layer | accuracy | control | selectivity | ablate: change | steer ABBA to BABA: change |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, layer in enumerate(layers):
        print(
            f"| {layer.split('.')[-1]} | {result.accuracy[layer]:.2f} | {result.control_accuracy[layer]:.2f} | "
            f"{result.selectivity[layer]:+.2f} | {ablated[i]:+.2f} | {steered[i]:+.2f} |"
        )
    draw(result, layers, ablated, steered, clean, out / "probes_ioi.png")
    print(f"\nwrote {out}/probes_ioi.png in {time.perf_counter() - started:.0f} s")


def draw(result: Any, layers: list[str], ablated: list[float], steered: list[float], clean: float, path: Path) -> None:
    """Accuracy and control accuracy per layer above; the interventions' change of the logit difference below."""
    x = [int(name.split(".")[-1]) for name in layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True, constrained_layout=True)
    top.plot(x, [result.accuracy[n] for n in layers], "o-", color="tab:blue", label="probe accuracy (held out)")
    top.plot(
        x,
        [result.control_accuracy[n] for n in layers],
        "s--",
        color="tab:gray",
        label="control task (a random label per indirect object's name)",
    )
    top.set_ylabel("accuracy", fontsize=10)
    top.set_ylim(0.3, 1.02)
    top.legend(fontsize=9, loc="lower right")
    top.set_title("SmolLM2-135M, IOI: is the indirect object the first name? (last position)", fontsize=10)
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.plot(x, ablated, "o-", color="tab:red", label="ablate the direction (all prompts)")
    bottom.plot(x, steered, "^-", color="tab:purple", label="steer ABBA prompts to BABA")
    bottom.set_ylabel(f"change of logit diff.\n(clean {clean:.2f})", fontsize=10)
    bottom.set_xlabel("layer (residual stream after it)", fontsize=10)
    bottom.legend(fontsize=9, loc="lower left")
    for ax in (top, bottom):
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--prompts", type=int, default=400, help="prompts the probes are trained and scored on")
    parser.add_argument("--checked", type=int, default=80, help="prompts of the causal checks")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=1, help="probe every n-th layer")
    args = parser.parse_args()
    main(args.out, args.prompts, args.checked, threads=args.threads, every=args.every)
