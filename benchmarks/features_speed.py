"""What a unit means, at speed: ``feature_statistics`` against its forward passes, SAEDashboard and delphi's caching.

Run from the repository root: python -m benchmarks.features_speed [--rounds 3] [--sizes 256 1024] [--write-inc]
(``--from-results --write-inc`` re-renders ``docs/methods/features_speed.inc`` from ``<work>/results.json``).

Every run reads the 4,608 features of one TopK SAE (576 -> 4608, k = 32) at SmolLM2-135M-Instruct's layer-15 MLP
output (``model.layers.15.mlp``; TransformerLens ``blocks.15.hook_mlp_out``) over the first sequences of 64 tokens
of the standard library's docstrings (``corpus()`` of ``examples/dictionaries_smollm2.py``, cut the same way; it
has 1,034 and ``corpus()`` keeps the last 16 apart, so the first 1,024 are taken directly), 32 sequences per
forward, k = 20 top examples per feature, on the CPU with 2 threads. Each measurement is its own process under
``flock /tmp/hookscope-heavy.lock``, one after another; model loading and conversion are never timed.

0. Setup, once: the tokens and the SAE, trained for 2 passes over those 65,536 tokens with ``train_dictionary``
   (32 steps of 4,096, lr 4e-4: a short training, so that densities are those of a trained TopK SAE rather than of
   random weights; it reads the same tokens it is then measured on, which does not matter for speed), kept in
   ``<work>/``.
1. Ours and the floor, interleaved in one process (median of ``--rounds``): ``feature_statistics(model, tokens,
   Features(sae, site), k=20, bands=10 | 0, batch_size=32, progress=False)`` (two passes with bands, one without;
   co-activation sums on, its default for dictionary features) against the forward passes it needs: the whole
   model, the model stopped after the site (as ours stops: a hook raises), and that plus the SAE's encode. Also with
   ``cache=`` a temporary folder: the first pass keeps the site's tensors on disk and the second reads them, so the
   model runs once.
2. Peak memory, each size in a fresh process: VmHWM of ``/proc/self/status``, reset (``/proc/self/clear_refs``)
   after the model, tokens and SAE are loaded, so that it is the peak of the call; the RSS before the call is given;
   with bands=10, without and with ``cache=``.
3. SAEDashboard (its own venv): ``SaeVisRunner.run`` as its ``NeuronpediaRunner`` calls it, minus the loading from
   the Hub and the JSON written after each batch: features in batches of 128, 32 sequences per forward, its
   activation cache (``cache_dir``, emptied first, so the forwards are timed), top 20 + 5 quantile groups of 5,
   BOS/EOS/pad ignored, float32. The model: a ``HookedSAETransformer`` built offline from our loaded model with
   TransformerLens' own ``convert_llama_weights`` and a config written as its Llama entry does, with two changes:
   ``rotary_base`` = SmolLM2's rope_theta (100,000; its generic Llama entry leaves TransformerLens' 10,000) and
   ``n_ctx`` 256 (8,192 would allocate 2 GB of causal masks); its layer-15 MLP output is checked against ours.
   The SAE: SAELens' ``TopKSAE`` holding the same tensors (``rescale_acts_by_decoder_norm=True``, which the
   runner's ``fold_W_dec_norm`` requires; the decoder rows have unit norm, so the features are the same, checked).
4. delphi (its own venv): ``LatentCache.run`` + ``save_splits`` (5 splits), the caching of its ``populate_cache``:
   the whole model (it does not stop at the site), 32 sequences per forward, our SAE's ``encode``, every non-zero
   activation kept in memory; its top examples are built later, when the explainer reads the cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

LAYER, LENGTH, WIDTH, FEATURES, TOPK, K, BATCH = 15, 64, 576, 4608, 32, 20, 32
SITE, HOOK = f"model.layers.{LAYER}.mlp", f"blocks.{LAYER}.hook_mlp_out"
LOCK = "/tmp/hookscope-heavy.lock"
ROOT = Path(__file__).resolve().parents[1]
VENVS = {"saedashboard": "saedashboard", "delphi": "delphi"}
PACKAGES = {"saedashboard": "sae-dashboard", "delphi": "eai-delphi"}


# -- setup ----------------------------------------------------------------------------------------------------------


def load(work: Path, sequences: int) -> tuple[Any, Any, torch.Tensor, Any]:
    """The model, its tokenizer, the first ``sequences`` sequences and the SAE of ``<work>/sae``."""
    sys.path.insert(0, str(ROOT / "examples"))
    from _smollm2 import load_smollm2

    from attribution import load_dictionary

    model, tokenizer = load_smollm2()
    tokens = torch.load(work / "tokens.pt")[:sequences]
    return model, tokenizer, tokens, load_dictionary(work / "sae")


def prepare(work: Path, sequences: int) -> None:
    """Write ``<work>/tokens.pt`` and train the SAE into ``<work>/sae`` (once)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from _smollm2 import load_smollm2
    from dictionaries_smollm2 import stdlib_text

    from attribution import SAE, train_dictionary

    model, tokenizer = load_smollm2()
    ids = torch.tensor(tokenizer(stdlib_text(), add_special_tokens=False).input_ids)
    if len(ids) < sequences * LENGTH:
        raise SystemExit(f"the corpus has {len(ids) // LENGTH} sequences of {LENGTH} tokens; {sequences} are needed")
    tokens = ids[: sequences * LENGTH].reshape(sequences, LENGTH)  # corpus()'s cut, without its 16 held out
    work.mkdir(parents=True, exist_ok=True)
    torch.save(tokens.clone(), work / "tokens.pt")
    parts: list[torch.Tensor] = []
    handle = model.get_submodule(SITE).register_forward_hook(lambda m, a, out: parts.append(out.reshape(-1, WIDTH)))
    try:
        forwards(model, tokens)  # stopped after the site (its hook runs after this one)
    finally:
        handle.remove()
    x = torch.cat(parts).float()
    sae = SAE(WIDTH, FEATURES, activation="topk", k=TOPK)
    shutil.rmtree(work / "sae-run", ignore_errors=True)
    train_dictionary(None, x, None, sae, out=work / "sae-run", tokens=2 * len(x), batch_size=4096, lr=4e-4, seed=0,
                     progress=False)  # fmt: skip
    sae.save(work / "sae")


# -- measuring ------------------------------------------------------------------------------------------------------


def _status(field: str) -> float:
    """A field of ``/proc/self/status`` in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measured(fn: Any) -> dict[str, float]:
    """Seconds of ``fn()``, the RSS before it and the peak RSS during it (VmHWM reset just before), in MiB."""
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss_before": before, "peak": _status("VmHWM")}


def ours(model: Any, tokens: torch.Tensor, sae: Any, bands: int, cache: bool = False) -> Any:
    import tempfile

    from attribution.features import Features, feature_statistics

    with tempfile.TemporaryDirectory(prefix="features-cache-") as folder:
        return feature_statistics(model, tokens, Features(sae, SITE), k=K, bands=bands, batch_size=BATCH,
                                  cache=folder if cache else None, progress=False)  # fmt: skip


class _Stop(Exception):
    pass


def forwards(model: Any, tokens: torch.Tensor, sae: Any = None, stop: bool = True) -> None:
    """The bare forwards: whole, or stopped after the site by a raising hook (then the SAE's encode, if given)."""
    seen: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: torch.Tensor) -> None:
        seen.append(output)
        raise _Stop

    handle = model.get_submodule(SITE).register_forward_hook(hook) if stop else None
    try:
        with torch.no_grad():
            for batch in tokens.split(BATCH):
                try:
                    model(input_ids=batch, use_cache=False)
                except _Stop:
                    if sae is not None:
                        sae.encode(seen.pop())
                seen.clear()
    finally:
        if handle is not None:
            handle.remove()


def job_time(work: Path, sequences: int, rounds: int) -> dict[str, Any]:
    """Ours and the floors, interleaved, median of ``rounds``."""
    from benchmarks._timing import interleaved

    model, _, tokens, sae = load(work, sequences)
    variants = {
        "forward, whole model": lambda: forwards(model, tokens, stop=False),
        "forward to layer 15": lambda: forwards(model, tokens),
        "ours, bands=0 (1 pass)": lambda: ours(model, tokens, sae, 0),
        "ours, bands=10 (2 passes)": lambda: ours(model, tokens, sae, 10),
        "ours, bands=10, cache= (1 forward)": lambda: ours(model, tokens, sae, 10, cache=True),
    }
    seconds = interleaved(variants, rounds, warmup=0)  # each call takes tens of seconds: no warm-up round
    return {"sequences": sequences, "rounds": rounds, "seconds": seconds, "version": _our_version()}


def job_memory(work: Path, sequences: int, cache: bool = False) -> dict[str, Any]:
    """Ours with bands=10 (and the site tensors cached on disk), once, in this fresh process."""
    model, _, tokens, sae = load(work, sequences)
    return {**measured(lambda: ours(model, tokens, sae, 10, cache)), "version": _our_version()}


def job_floor(work: Path, sequences: int) -> dict[str, Any]:
    """The forwards to layer 15, once, in this fresh process."""
    model, _, tokens, _ = load(work, sequences)
    return measured(lambda: forwards(model, tokens))


def hooked_transformer(model: Any) -> Any:
    """SAEDashboard's model: a HookedSAETransformer with our model's weights (TransformerLens' Llama conversion)."""
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    c = model.config
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=256, eps=c.rms_norm_eps,
        d_vocab=c.vocab_size, act_fn=c.hidden_act, n_key_value_heads=c.num_key_value_heads,
        normalization_type="RMS", positional_embedding_type="rotary", rotary_adjacent_pairs=False,
        rotary_dim=c.hidden_size // c.num_attention_heads, rotary_base=float(rope["rope_theta"]), final_rms=True,
        gated_mlp=True, original_architecture="LlamaForCausalLM", dtype=torch.float32, device="cpu",
        default_prepend_bos=False,
    )  # fmt: skip
    hooked = HookedSAETransformer(cfg)
    hooked.load_and_process_state_dict(convert_llama_weights(model, cfg))  # from_pretrained's default processing
    return hooked.eval()


def saelens_sae(sae: Any) -> Any:
    """SAELens' TopKSAE with our SAE's tensors."""
    from sae_lens import TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    norms = sae.W_dec.detach().norm(dim=-1)
    if float((norms - 1).abs().max()) > 1e-4:
        raise SystemExit("the SAE's decoder rows must have unit norm for SAEDashboard's fold_W_dec_norm")
    cfg = TopKSAEConfig(d_in=sae.d_in, d_sae=sae.n_features, k=sae.k, dtype="float32", device="cpu",
                        apply_b_dec_to_input=True, rescale_acts_by_decoder_norm=True,
                        metadata=SAEMetadata(hook_name=HOOK))  # fmt: skip
    theirs = TopKSAE(cfg)
    theirs.load_state_dict({name: getattr(sae, name).detach().clone() for name in ("W_enc", "b_enc", "W_dec", "b_dec")})
    return theirs.eval()


def job_saedashboard(work: Path, sequences: int) -> dict[str, Any]:
    """SAEDashboard's feature data for every feature, as its NeuronpediaRunner asks for it."""
    import importlib.metadata

    from sae_dashboard.components_config import (
        ActsHistogramConfig,
        Column,
        FeatureTablesConfig,
        LogitsHistogramConfig,
        LogitsTableConfig,
        SequencesConfig,
    )
    from sae_dashboard.layout import SaeVisLayoutConfig
    from sae_dashboard.sae_vis_data import SaeVisConfig
    from sae_dashboard.sae_vis_runner import SaeVisRunner

    from attribution import record

    model, tokenizer, tokens, sae = load(work, sequences)
    hooked, encoder = hooked_transformer(model), saelens_sae(sae)
    with torch.no_grad():  # the same activations and the same features
        probe = tokens[:4]
        with record(model, SITE) as acts:
            model(input_ids=probe, use_cache=False)
        _, cache = hooked.run_with_cache(probe, names_filter=HOOK, stop_at_layer=LAYER + 1)
        act_error = float((cache[HOOK] - acts[SITE]).abs().max() / acts[SITE].abs().max())
        ours_f, theirs_f = sae.encode(acts[SITE]), encoder.encode(acts[SITE])
        feature_error = float((ours_f - theirs_f).abs().max() / ours_f.abs().max())
    del model, acts, cache
    gc.collect()
    cache_dir = work / f"saedashboard-cache-{sequences}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    layout = SaeVisLayoutConfig(columns=[Column(
        SequencesConfig(stack_mode="stack-all", buffer=None, compute_buffer=True, n_quantiles=5,  # type: ignore[arg-type]
                        top_acts_group_size=K, quantile_group_size=5),
        ActsHistogramConfig(), LogitsHistogramConfig(), LogitsTableConfig(), FeatureTablesConfig(n_rows=3),
    )])  # fmt: skip
    ignore = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}

    def run() -> None:
        for first in range(0, FEATURES, 128):  # NeuronpediaRunner: one SaeVisRunner per batch of features
            cfg = SaeVisConfig(
                hook_point=HOOK, features=list(range(first, min(first + 128, FEATURES))), minibatch_size_features=128,
                minibatch_size_tokens=BATCH, quantile_feature_batch_size=64, verbose=False, device="cpu",
                feature_centric_layout=layout, perform_ablation_experiments=False, dtype="float32",
                cache_dir=cache_dir, ignore_tokens=ignore, ignore_positions=[], use_dfa=False,
            )  # fmt: skip
            data = SaeVisRunner(cfg).run(encoder=encoder, model=hooked, tokens=tokens)
            del data
            gc.collect()

    result = measured(run)
    shutil.rmtree(cache_dir, ignore_errors=True)
    versions = {p: importlib.metadata.version(p) for p in ("sae-dashboard", "sae-lens", "transformer-lens")}
    return {**result, "version": ", ".join(f"{p} {v}" for p, v in versions.items()),
            "activation_error": act_error, "feature_error": feature_error}  # fmt: skip


def job_delphi(work: Path, sequences: int) -> dict[str, Any]:
    """delphi's latent cache: LatentCache.run and save_splits, as its populate_cache does."""
    import importlib.metadata

    from delphi.latents import LatentCache

    model, _, tokens, sae = load(work, sequences)
    out = work / f"delphi-{sequences}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    def run() -> None:
        cache = LatentCache(model, {SITE: sae.encode}, batch_size=BATCH)
        cache.run(tokens.numel(), tokens)
        cache.save_splits(n_splits=5, save_dir=out)

    with torch.no_grad():
        result = measured(run)
    shutil.rmtree(out, ignore_errors=True)
    return {**result, "version": f"eai-delphi {importlib.metadata.version('eai-delphi')}"}


def _our_version() -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"hookscope {commit.stdout.strip() or '?'}"


# -- the runs -------------------------------------------------------------------------------------------------------


def spawn(python: str, args: list[str], work: Path, threads: int) -> dict[str, Any]:
    """One job in its own process under the lock; its last JSON line (or the error)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}  # fmt: skip
    command = ["flock", LOCK, python, "-m", "benchmarks.features_speed", *args, "--work", str(work),
               "--threads", str(threads)]  # fmt: skip
    before = Path("/proc/loadavg").read_text().split()[:3]
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    after = Path("/proc/loadavg").read_text().split()[:3]
    (work / f"{'-'.join(a.lstrip('-') for a in args)}.log").write_text(run.stdout + run.stderr)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["(no output)"]
        result: dict[str, Any] = {"error": f"exit {run.returncode}: {tail[0]}"}
    else:
        result = json.loads(lines[-1])
    result["load"] = f"{' '.join(before)} -> {' '.join(after)}"
    return result


def main(args: argparse.Namespace) -> None:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    big = max(args.sizes)
    if not (work / "sae").is_dir() or not (work / "tokens.pt").is_file():
        start = time.perf_counter()
        done = spawn(sys.executable, ["--job", "prepare", "--sequences", str(big)], work, args.threads)
        if "error" in done:
            raise SystemExit(f"setup failed: {done['error']} (see {work}/job-prepare*.log)")
        print(f"tokens and SAE prepared in {time.perf_counter() - start:.0f} s", flush=True)
    path = work / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    jobs: list[tuple[str, str, list[str]]] = []
    if "ours" in args.only:
        timed = ["--job", "time", "--sequences", str(args.time_sequences), "--rounds", str(args.rounds)]
        jobs.append(("time", sys.executable, timed))
        for n in args.sizes:
            jobs.append((f"floor {n}", sys.executable, ["--job", "floor", "--sequences", str(n)]))
            jobs.append((f"memory {n}", sys.executable, ["--job", "memory", "--sequences", str(n)]))
            jobs.append((f"cached {n}", sys.executable, ["--job", "cached", "--sequences", str(n)]))
    for peer in ("saedashboard", "delphi"):
        if peer in args.only:
            python = str(args.venvs / VENVS[peer] / "bin" / "python")
            jobs += [(f"{peer} {n}", python, ["--job", peer, "--sequences", str(n)]) for n in args.sizes]
    for key, python, job in jobs:
        if not Path(python).is_file():
            results[key] = {"error": f"not installed: {python} is missing"}
        else:
            results[key] = spawn(python, job, work, args.threads)
        print(key, json.dumps(results[key]), flush=True)
        path.write_text(json.dumps(results, indent=1))
    text = render(results, args.threads)
    print(text)
    if args.write_inc:
        (ROOT / "docs" / "methods" / "features_speed.inc").write_text(text)


def render(results: dict[str, Any], threads: int) -> str:
    """The table of ``results.json`` as reStructuredText."""
    rows: list[list[str]] = []
    timing = results.get("time", {})
    seconds: dict[str, float] = timing.get("seconds", {})
    n = timing.get("sequences", 0)
    floor1 = seconds.get("forward to layer 15")
    for name, value in seconds.items():
        passes = 2 if "2 passes" in name else 1
        ratio = f"{value / (passes * floor1):.2f}x floor" if floor1 and name.startswith("ours") else ""
        tokens = n * LENGTH
        rows.append([f"{name}, median", f"{tokens:,}", f"{value:.1f}", f"{tokens / value:,.0f}", ratio, "", ""])
    by_size: dict[str, dict[int, float]] = {}
    labels = {"floor": "forward to layer 15, fresh process", "memory": "ours, bands=10 (2 passes), fresh process",
              "cached": "ours, bands=10, cache= (1 forward), fresh process",
              "saedashboard": "SAEDashboard SaeVisRunner (feature data)",
              "delphi": "delphi LatentCache (caching only)"}  # fmt: skip
    order = ["floor", "memory", "cached", "saedashboard", "delphi"]
    keyed = sorted((k for k in results if k != "time"), key=lambda k: (order.index(k.split()[0]), int(k.split()[1])))
    for key in keyed:
        r = results[key]
        kind, sequences = key.split()[0], int(key.split()[1])
        tokens = sequences * LENGTH
        if "seconds" not in r:
            rows.append([labels[kind], f"{tokens:,}", "", "", "", "", r.get("error", "?")])
            continue
        by_size.setdefault(kind, {})[sequences] = r["seconds"]
        ratio = ""
        floor = by_size.get("floor", {}).get(sequences)
        mine = by_size.get("memory", {}).get(sequences)
        cached = by_size.get("cached", {}).get(sequences)
        if kind in ("memory", "cached") and floor:
            ratio = f"{r['seconds'] / ((2 if kind == 'memory' else 1) * floor):.2f}x floor"
        elif kind in ("saedashboard", "delphi") and mine:
            ratio = f"ours {r['seconds'] / mine:.2f}x" + (f", {r['seconds'] / cached:.2f}x cached" if cached else "")
        peak = f"{r['peak']:,.0f} (+{r['peak'] - r['rss_before']:,.0f})"
        rows.append([labels[kind], f"{tokens:,}", f"{r['seconds']:.1f}", f"{tokens / r['seconds']:,.0f}", ratio, peak,
                     ""])  # fmt: skip
    header = ["what was run", "tokens", "seconds", "tokens/s", "ratio", "peak RSS MiB (+ in the call)", "note"]
    keep = [i for i in range(len(header)) if i != 6 or any(r[6] for r in rows)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return ("   " + "  ".join(r[i].ljust(widths[i]) for i in keep)).rstrip()

    rule = "   " + "  ".join("=" * widths[i] for i in keep)
    versions = sorted({r["version"] for r in results.values() if "version" in r})
    loads = "; ".join(f"{key} {r['load']}" for key, r in results.items() if "load" in r)
    intro = (
        "4,608 features of a TopK SAE (576 -> 4608, k = 32, briefly trained) at SmolLM2-135M-Instruct's layer-15 MLP "
        "output, k = 20 top examples, sequences of 64 tokens of the standard library's docstrings, 32 per forward; "
        f"CPU, {threads} threads on a machine of 2 cores shared with other jobs (each measurement its own process "
        f"under a lock, one after another); torch {torch.__version__}; {'; '.join(versions)}. The first rows: medians "
        f"of {timing.get('rounds', '?')} interleaved rounds in one process; the others: one run each in a fresh "
        "process. "
        "Ratio: ours' time over that of the forwards to layer 15 it needs (one per pass), or the peer's time over "
        "ours at the same size (ours is that many times faster). Peak RSS: VmHWM during the call (reset after "
        "loading); in brackets, what the call added to the RSS before it. Command: "
        "``python -m benchmarks.features_speed --write-inc``; what each peer runs is in the script's docstring."
    )
    table = [rule, line(header), rule, *map(line, rows), rule]
    notes = f"Load average (1/5/15 min) before -> after each: {loads}."
    return intro + "\n\n" + "\n".join(table) + "\n\n" + notes + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-sequences", type=int, default=256, help="sequences of the interleaved timing")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="sequences of 64 tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hookscope-features-speed"))
    parser.add_argument("--venvs", type=Path, default=Path("/work/venvs"), help="<venvs>/<peer>/bin/python")
    parser.add_argument("--only", nargs="+", default=["ours", "saedashboard", "delphi"],
                        choices=["ours", "saedashboard", "delphi"])  # fmt: skip
    parser.add_argument("--write-inc", action="store_true", help="write docs/methods/features_speed.inc")
    parser.add_argument("--from-results", action="store_true", help="only render <work>/results.json")
    jobs = ["prepare", "time", "floor", "memory", "cached", "saedashboard", "delphi"]
    parser.add_argument("--job", choices=jobs, help=argparse.SUPPRESS)
    parser.add_argument("--sequences", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        if args.job == "prepare":
            prepare(args.work, args.sequences)
            print(json.dumps({"done": True}))
        else:
            fn = {"time": lambda: job_time(args.work, args.sequences, args.rounds),
                  "memory": lambda: job_memory(args.work, args.sequences),
                  "cached": lambda: job_memory(args.work, args.sequences, cache=True),
                "floor": lambda: job_floor(args.work, args.sequences),
                  "saedashboard": lambda: job_saedashboard(args.work, args.sequences),
                  "delphi": lambda: job_delphi(args.work, args.sequences)}[args.job]  # fmt: skip
            print(json.dumps(fn()))
    elif args.from_results:
        text = render(json.loads((args.work / "results.json").read_text()), args.threads)
        print(text)
        if args.write_inc:
            (ROOT / "docs" / "methods" / "features_speed.inc").write_text(text)
    else:
        main(args)
