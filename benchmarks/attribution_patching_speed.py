"""Attribution patching time: against one forward + backward, exact activation patching and TransformerLens 4.3.

Run from the repository root: python -m benchmarks.attribution_patching_speed [--rounds 5] [--threads 1]

1. SmolLM2-135M-Instruct (examples/_smollm2.py; skipped if its weights are not installed), the 20 IOI prompts of
   examples/ioi_demo.py (batch 20, 14 tokens), metric = mean logit difference IO - S. Floor: one forward with
   autograd and a backward to every parameter (``metric(model(x)).backward()``). Timed: attribution patching of the
   residual stream (inputs of the 30 layers and of the final norm) by layer x position, 434 cells, and of every head
   by layer x position x head (inputs of the 30 ``o_proj``, 3780 cells); each call includes its clean forward.
   Exact activation patching of the residual sweep is timed once (434 forwards); that of the head sweep (3780
   forwards) is extrapolated from exact sweeps of the first and the last layer's heads (126 forwards each): with
   replay a cell's forward runs from its layer on, so the time per layer falls about linearly with its index.
2. The 4-layer reference model of benchmarks/patching_speed.py (d_model 256, 8 heads, batch 8, seq 32), against
   TransformerLens' ``attribution_patch`` on its native model with the same weights: the same node scores (token
   embedding by position, each head by position, each MLP output by position); ours in three calls, one per kind
   of site. Metric: logit difference of one answer pair at the last position (TransformerLens gives its metric one
   example's logits at a time, so the pair is the same for all examples). The results are checked against each other
   first.
3. RelP against AtP (``rules="relp"`` against the default) on SmolLM2 and the IOI prompts of 1.: the same two sweeps
   (residual stream, heads) with each backward, beside the floor; the claim checked is "same cost as AtP".
   ``--relp`` runs this part alone.

The machine may be shared: the load average is printed; variants run interleaved and medians are quoted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from attribution import activation_patching
from attribution._maps import spearman
from attribution.attribution_patching import attribution_patching
from benchmarks._timing import interleaved, setup, table
from benchmarks.patching_speed import CONFIG, inputs
from tests.attribution.models import TinyGPT


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def smollm2(rounds: int) -> None:
    try:
        from examples._smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        print(f"SmolLM2 part skipped: {exc}")
        return
    model, tokenizer = load_smollm2()
    ioi = ioi_prompts(tokenizer)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff
    n_layers = model.config.num_hidden_layers
    resid = [f"model.layers.{i}" for i in range(n_layers)] + ["model.norm"]
    heads = "model.layers.*.self_attn.o_proj"

    def floor() -> None:
        metric(model(**corrupted)).backward()
        model.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            model(**corrupted)

    variants: dict[str, Callable[[], Any]] = {
        "1 forward (no autograd)": forward,
        "1 forward + backward (floor)": floor,
        "AtP residual, layer x position": lambda: attribution_patching(
            model, clean, corrupted, resid, metric, site="input"
        ),
        "AtP heads, layer x position x head": lambda: attribution_patching(
            model, clean, corrupted, heads, metric, site="input", heads=9
        ),
    }
    times = interleaved(variants, repeats=rounds, warmup=1)

    start = time.perf_counter()
    exact = activation_patching(model, clean, corrupted, resid, metric, site="input", progress=False)
    exact_resid = time.perf_counter() - start
    ends = []  # exact head sweeps of the first and the last layer, 126 cells each
    for layer in (0, n_layers - 1):
        start = time.perf_counter()
        name = f"model.layers.{layer}.self_attn.o_proj"
        activation_patching(model, clean, corrupted, name, metric, site="input", heads=9, progress=False)
        ends.append(time.perf_counter() - start)
    # replay runs a cell's forward from its layer on, so a layer's sweep costs about an affine function of its index
    exact_heads = n_layers * sum(ends) / 2
    estimate = attribution_patching(model, clean, corrupted, resid, metric, site="input")
    with torch.no_grad():
        low, high = float(metric(model(**corrupted))), float(metric(model(**clean)))
    share = (estimate - low) / (high - low), (exact - low) / (high - low)  # 0 = corrupted, 1 = clean
    rho = float(spearman(estimate.flatten()[None], exact.flatten()[None])[0])
    print(
        f"residual sweep, normalised: max |AtP - exact| = {(share[0] - share[1]).abs().max():.2f}, Spearman "
        f"{rho:.2f}; exact at S2 (position 9) by layer input: "
        + " ".join(f"{v:.2f}" for v in share[1][:, 9].tolist())
        + "; at the end: "
        + " ".join(f"{v:.2f}" for v in share[1][:, -1].tolist())
    )
    floor_s = times["1 forward + backward (floor)"]
    rows = [[name, f"{s:.2f}", f"{s / floor_s:.2f}", "", ""] for name, s in times.items()]
    rows[2][3:] = [f"{exact_resid:.0f} (timed once)", f"{exact_resid / times['AtP residual, layer x position']:.0f}x"]
    rows[3][3:] = [
        f"{exact_heads:.0f} (extrapolated)",
        f"{exact_heads / times['AtP heads, layer x position x head']:.0f}x",
    ]
    print(f"\nSmolLM2-135M, 20 IOI prompts x 14 tokens, median of {rounds}; {load()}")
    print(table(["variant", "s", "x floor", "exact activation_patching, s", "AtP speed-up"], rows))


def relp(rounds: int) -> None:
    try:
        from examples._smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        print(f"RelP part skipped: {exc}")
        return
    model, tokenizer = load_smollm2()
    ioi = ioi_prompts(tokenizer)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff
    resid = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)] + ["model.norm"]
    sweeps = {"residual, layer x position": {"layers": resid}, "heads, layer x position x head": {
        "layers": "model.layers.*.self_attn.o_proj", "heads": 9}}  # fmt: skip

    def floor() -> None:
        metric(model(**corrupted)).backward()
        model.zero_grad(set_to_none=True)

    variants: dict[str, Callable[[], Any]] = {"1 forward + backward (floor)": floor}
    for sweep, options in sweeps.items():
        for rules in ("gradient", "relp"):
            variants[f"{'AtP' if rules == 'gradient' else 'RelP'} {sweep}"] = lambda options=options, rules=rules: (
                attribution_patching(model, clean, corrupted, metric=metric, site="input", rules=rules, **options)
            )
    times = interleaved(variants, repeats=rounds, warmup=1)
    floor_s = times["1 forward + backward (floor)"]
    rows = [["1 forward + backward (floor)", f"{floor_s:.2f}", "1.00", ""]]
    for sweep in sweeps:
        atp, rel = times[f"AtP {sweep}"], times[f"RelP {sweep}"]
        rows.append([f"AtP {sweep}", f"{atp:.2f}", f"{atp / floor_s:.2f}", ""])
        rows.append([f"RelP {sweep}", f"{rel:.2f}", f"{rel / floor_s:.2f}", f"{rel / atp:.2f}"])
    print(f"\nRelP vs AtP, SmolLM2-135M, 20 IOI prompts x 14 tokens, median of {rounds}; {load()}")
    print(table(["variant", "s", "x floor", "RelP / AtP"], rows))


def reference_model(rounds: int) -> None:
    model = TinyGPT(CONFIG).eval()
    clean, corrupted, answers = inputs()
    a, b = (int(t) for t in answers[0])

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, a] - logits[:, -1, b]).mean()

    def ours() -> dict[str, torch.Tensor]:
        base = metric(model(corrupted)).detach()
        return {
            "embed": attribution_patching(model, clean, corrupted, "tok_embed", metric)[0] - base,
            "heads": attribution_patching(model, clean, corrupted, "layers.*.attn.o", metric, site="input", heads=8)
            - base,
            "mlp": attribution_patching(model, clean, corrupted, "layers.*.mlp", metric) - base,
        }

    variants: dict[str, Callable[[], Any]] = {"hookscope attribution_patching (3 calls)": ours}
    try:
        from transformer_lens import TransformerBridge
        from transformer_lens.tools.analysis.attribution_patching import attribution_patch
    except ImportError:
        print("transformer_lens is not installed: its row is left out")
    else:
        bridge = TransformerBridge.boot_native(dict(CONFIG))
        loaded = bridge.load_state_dict(model.state_dict(), strict=False)
        assert not loaded.unexpected_keys, loaded.unexpected_keys
        bridge.eval()

        def theirs() -> dict[str, torch.Tensor]:
            with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
                scores = attribution_patch(bridge, clean, corrupted, lambda logits: logits[0, -1, a] - logits[0, -1, b])
            out = {"embed": torch.zeros(clean.shape[1]), "heads": torch.zeros(4, clean.shape[1], 8),
                   "mlp": torch.zeros(4, clean.shape[1])}  # fmt: skip
            for node, score in scores.node_scores.items():
                if node.kind == "embed":
                    out["embed"][node.position] = score
                elif node.kind == "attn_head_out":
                    out["heads"][node.layer, node.position, node.head] = score
                else:
                    out["mlp"][node.layer, node.position] = score
            return out

        variants["TransformerLens attribution_patch (node)"] = theirs

    results = {name: fn() for name, fn in variants.items()}  # also the warm-up
    if len(results) == 2:
        mine, peer = results.values()
        worst = max((mine[k] - peer[k]).abs().max().item() for k in mine)
        print(f"max |ours - TransformerLens| over {sum(v.numel() for v in mine.values())} node scores: {worst:.1e}")
        assert worst < 1e-4, worst
    times = interleaved(variants, repeats=rounds, warmup=0)
    names = list(times)
    rows = [[name, f"{s:.3f}", f"{s / times[names[-1]]:.2f}"] for name, s in times.items()]
    print(
        f"\n{CONFIG['n_layers']} layers, d_model {CONFIG['d_model']}, {CONFIG['n_heads']} heads, "
        f"batch {clean.shape[0]}, seq {clean.shape[1]}: node scores (embed, heads, MLPs by position), "
        f"median of {rounds}; {load()}"
    )
    print(table(["method", "s", "x TL" if len(names) > 1 else "x self"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed repetitions per variant (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--skip-smollm2", action="store_true", help="only the reference-model comparison")
    parser.add_argument("--relp", action="store_true", help="only RelP against AtP (part 3)")
    args = parser.parse_args()
    setup(args.threads)
    print(load())
    if args.relp:
        relp(args.rounds)
        return
    reference_model(args.rounds)
    if not args.skip_smollm2:
        smollm2(args.rounds)
        relp(args.rounds)


if __name__ == "__main__":
    main()
