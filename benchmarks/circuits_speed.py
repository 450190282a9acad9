"""Edge attribution time and memory: EAP and EAP-IG against the floor of the passes they need, on SmolLM2.

Run from the repository root: python -m benchmarks.circuits_speed [--rounds 3] [--threads 2]

SmolLM2-135M-Instruct (examples/_smollm2.py; skipped if its weights are not installed; 30 layers, 9 query heads in 3
key/value groups, 70,651 edges), the 20 IOI prompts of examples/ioi_demo.py (batch 20, 14 tokens), metric = mean
logit difference IO - S at the last token. Floor: one clean forward with autograd from the input embeddings, one
corrupted forward without, and one backward to the input embeddings (no parameter gradients). Timed: all edges by
EAP (``ig_steps=1``) and by EAP-IG (``ig_steps=5``). Peak memory: the tensors each call creates (parameters and
inputs excluded), with benchmarks._timing.memory; EAP's peak at batch 10 and 20 shows how it grows with the batch.
Then ``exact_edge_effects`` of EAP's top 48 edges with 1, 8 and 16 edges per forward, on 20 prompts and on 2.

Second table: a random HF GPT-2 (4 layers, 8 heads, d_model 256; batch 8, 32 tokens) against TransformerLens 4.3's
edge attribution patching (``attribution_patch(..., granularity="edge")`` on ``TransformerBridge.boot_transformers``
wrapping the same HF model; it scores one example per forward and backward, each edge per position, and refuses
grouped-query attention, so it cannot run SmolLM2). TransformerLens linearises at the corrupted run toward the clean
one; ours is called with the two inputs swapped, which then estimates the same quantity: its per-position scores,
summed over positions, are compared with ours first.

The machine may be shared: the load average is printed; variants run interleaved and medians are quoted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

from attribution.circuits import edge_attribution, exact_edge_effects
from benchmarks._timing import interleaved, memory, setup, table


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def floor_passes(model: Any, clean: dict, corrupted: dict, metric: Any) -> None:
    """Clean forward with autograd from the input embeddings, corrupted forward, backward to the embeddings."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        model(**corrupted)
        start = embed(clean["input_ids"])
    start.requires_grad_(True)
    inputs = {k: v for k, v in clean.items() if k != "input_ids"}
    value = metric(model(inputs_embeds=start, **inputs))
    torch.autograd.grad(value, start)


def smollm2(rounds: int) -> None:
    try:
        from examples._smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        print(f"SmolLM2 part skipped: {exc}")
        return
    model, tokenizer = load_smollm2()
    for p in model.parameters():
        p.requires_grad_(False)
    ioi = ioi_prompts(tokenizer)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff
    variants = {
        "floor": lambda: floor_passes(model, clean, corrupted, metric),
        "EAP": lambda: edge_attribution(model, clean, corrupted, metric, progress=False),
        "EAP-IG (k=5)": lambda: edge_attribution(model, clean, corrupted, metric, ig_steps=5, progress=False),
    }
    print(load())
    times = interleaved(variants, rounds)
    peaks = {name: memory(fn)[0] for name, fn in variants.items()}
    base = times["floor"]
    rows = [[name, f"{t:.2f}", f"{t / base:.2f}x", f"{peaks[name]:.0f}"] for name, t in times.items()]
    print(table(["SmolLM2, 20 IOI prompts, 70,651 edges", "seconds (median)", "x floor", "peak MiB"], rows))

    half = {k: v[:10] if k == "input_ids" else v for k, v in clean.items()}
    half_corrupted = {k: v[:10] if k == "input_ids" else v for k, v in corrupted.items()}
    ioi_half = ioi_prompts(tokenizer)
    ioi_half.io, ioi_half.s = ioi.io[:10], ioi.s[:10]
    peak_10 = memory(lambda: edge_attribution(model, half, half_corrupted, ioi_half.mean_logit_diff, progress=False))
    writers, d_model = 1 + 30 * 10, model.config.hidden_size
    buffer = writers * 20 * 14 * d_model * 4 / 2**20
    print(f"EAP peak: batch 10 {peak_10[0]:.0f} MiB, batch 20 {peaks['EAP']:.0f} MiB; the writers' deltas at batch 20 "
          f"are {buffer:.0f} MiB (301 writers x 20 x 14 tokens x {d_model} float32)")  # fmt: skip
    exact_effects(model, clean, corrupted, metric, rounds, "20 prompts")
    two = ioi_prompts(tokenizer)
    two.clean, two.corrupted, two.io, two.s = ioi.clean[:2], ioi.corrupted[:2], ioi.io[:2], ioi.s[:2]
    exact_effects(model, two.inputs("clean"), two.inputs("corrupted"), two.mean_logit_diff, rounds, "2 prompts")
    print(load())


def exact_effects(model: Any, clean: dict, corrupted: dict, metric: Any, rounds: int, label: str) -> None:
    """exact_edge_effects of EAP's top 48 edges: one edge per forward against 8 and 16 edges per forward."""
    top = [(w, r) for w, r, _ in edge_attribution(model, clean, corrupted, metric, progress=False).edges(48)]

    def per_forward(k: int) -> Callable[[], Any]:
        return lambda: exact_edge_effects(model, clean, corrupted, metric, top, edges_per_run=k, progress=False)

    variants = {f"{k} edge(s) per forward": per_forward(k) for k in (1, 8, 16)}
    results = {name: fn() for name, fn in variants.items()}
    one = results["1 edge(s) per forward"]
    worst = max(float((r - one).abs().max()) for r in results.values()) / float(one.abs().max())
    times = interleaved(variants, rounds, warmup=0)
    base = times["1 edge(s) per forward"]
    rows = [[name, f"{t:.2f}", f"{base / t:.2f}x"] for name, t in times.items()]
    print(table([f"exact effects of EAP's top 48 edges (SmolLM2, {label})", "seconds (median)", "speed-up"], rows))
    print(f"largest difference from one edge per forward: {worst:.1e} of the largest |effect| (float32)")


def _tl_name(node: Any) -> str:
    """Our node name for a TransformerLens edge-attribution node."""
    kind, layer, head = node.kind, node.layer, node.head
    return {
        "embed": "embed",
        "attn_head_out": f"a{layer}.h{head}",
        "mlp_out": f"m{layer}",
        "q_input": f"a{layer}.h{head}.q",
        "k_input": f"a{layer}.g{head}.k",
        "v_input": f"a{layer}.g{head}.v",
        "mlp_in": f"m{layer}",
        "logits": "logits",
    }[kind]


def gpt2_style(rounds: int) -> None:
    import contextlib
    import copy

    import transformers

    config = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=256, n_layer=4, n_head=8,
                                     attn_implementation="eager")  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    clean = torch.randint(0, 512, (8, 32))
    corrupted = clean.clone()
    for p in (2, 9, 17):
        corrupted[:, p] = (clean[:, p] + torch.randint(1, 512, (8,))) % 512
    a, b = 3, 4

    def metric(out: Any) -> torch.Tensor:
        return (out.logits[:, -1, a] - out.logits[:, -1, b]).mean()

    # TransformerLens linearises at the corrupted run toward the clean one: ours with the two inputs swapped
    variants = {"hookscope edge_attribution (EAP)": lambda: edge_attribution(model, corrupted, clean, metric,
                                                                              progress=False)}  # fmt: skip
    try:
        import tokenizers
        from transformer_lens import TransformerBridge
        from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch
    except ImportError:
        print("transformer_lens is not installed: its row is left out")
    else:
        vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab)  # not used; avoids a download
        # the bridge replaces the HF model's submodules by its own: it gets a copy (same weights)
        bridge = TransformerBridge.boot_transformers("gpt2", hf_model=copy.deepcopy(model), tokenizer=tokenizer)
        bridge.eval()
        edge = EdgeAttributionConfig(granularity="edge")

        def theirs() -> Any:
            with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
                return attribution_patch(bridge, clean, corrupted, lambda x: x[0, -1, a] - x[0, -1, b], edge)

        variants["TransformerLens 4.3 attribution_patch (edge)"] = theirs
    results = {name: fn() for name, fn in variants.items()}  # also the warm-up
    ours = results["hookscope edge_attribution (EAP)"]
    if len(results) == 2:
        summed: dict[tuple[str, str], float] = {}
        for (w, r), value in results["TransformerLens 4.3 attribution_patch (edge)"].edge_scores.items():
            key = (_tl_name(w), _tl_name(r))
            summed[key] = summed.get(key, 0.0) + value
        mine = {(w, r): s for w, r, s in ours.edges()}
        common = sorted(set(summed) & set(mine))
        diff = max(abs(summed[k] - mine[k]) for k in common) / max(abs(v) for v in mine.values())
        print(
            f"GPT-2 style: {len(mine)} edges (ours), TransformerLens' per-position edges summed over positions: "
            f"{len(summed)}, {len(common)} in common; largest difference {diff:.1e} of the largest |score|"
        )
    times = interleaved(variants, rounds, warmup=0)
    peaks = {name: memory(fn)[0] for name, fn in variants.items()}
    rows = [[name, f"{t:.3f}", f"{peaks[name]:.0f}"] for name, t in times.items()]
    print(table(["GPT-2 style, 4 layers x 8 heads, d 256, batch 8 x 32 tokens", "seconds (median)", "peak MiB"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup(args.threads)
    smollm2(args.rounds)
    gpt2_style(args.rounds)


if __name__ == "__main__":
    main()
