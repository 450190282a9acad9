"""Sparse dictionaries against the peers: SAELens, sparsify and dictionary_learning on the same cached activations.

Run from the repository root: python -m benchmarks.dictionary_peers [--steps 24] [--venvs /work/venvs] [--write-inc]

1. Activations, once: SmolLM2-135M-Instruct's layer-15 MLP output (``model.layers.15.mlp``) on the first 1024
   sequences of 64 tokens of the standard library's docstrings (the corpus of ``examples/dictionaries_smollm2.py``),
   65,536 x 576 float32, written to ``<work>/activations.npy``. Sequences 0-895 (57,344 rows) train, sequences
   896-1023 (8,192 rows) are held out.
2. Each trainer trains a TopK SAE (576 -> 4608, k = 32) for ``--steps`` steps of 4096 rows, Adam at lr 4e-4, on
   the CPU with 2 threads, in its own process: ours with the running Python, each peer with
   ``<venvs>/<peer>/bin/python`` (a virtual environment made with ``--system-site-packages``, so that all use the
   same torch). The peers get the rows in the same order as ours (one seeded permutation per pass). Only the
   training call is timed (for each trainer the call that runs its loop, its own final save included); tokens/s
   is steps x 4096 over that time. Every timed process runs under ``flock /tmp/hookscope-heavy.lock``.
3. Each trainer's saved folder is read back with :func:`attribution.load_dictionary` and the held-out FVU
   (``sum |x - x_hat|^2 / sum |x - mean(x)|^2``) and L0 are computed by one function here, for all alike.

What each peer is given (its own training recipe otherwise, named in the table's notes):

* SAELens (``SAETrainer`` + ``TopKTrainingSAE``): constant lr, ``dead_feature_window`` set to ours (ours counts a
  feature dead after ``max(4096, tokens // 10)`` tokens without firing); its defaults otherwise
  (``rescale_acts_by_decoder_norm=True``, ``decoder_init_norm=0.1``, AuxK coefficient 1, no ``b_dec`` start at the
  data mean); after training the decoder norms are folded in with its own ``fold_W_dec_norm`` (the same function,
  unit rows) and it is saved with ``save_model``.
* sparsify (``Trainer``, which records activations from a model by itself and takes no cached ones): the "model" is
  an ``nn.Embedding`` holding the training rows and the "tokens" are row indices, so its hook sees exactly the
  cached rows; ``SPARSIFY_DISABLE_TRITON=1`` (its option for the eager decoder: its Triton kernel needs a GPU and
  fails on the CPU with "0 active drivers"); Adam, ``lr_warmup_steps=0`` (its schedule still decays linearly to 0
  over the run; no option turns that off), ``auxk_alpha=1/32``, ``dead_feature_threshold`` set to ours, batch 64
  sequences of 64 rows.
* dictionary_learning (``trainSAE`` + ``TopKTrainer``): ``warmup_steps=0``, no decay; its dead-feature threshold is
  fixed at 10M tokens in the constructor, so in a short run its AuxK loss never runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

WIDTH, FEATURES, K, BATCH, LR, SEED = 576, 4608, 32, 4096, 4e-4, 0
LAYER, LENGTH, SEQUENCES, TRAIN_SEQUENCES = 15, 64, 1024, 896
TRAIN_ROWS = TRAIN_SEQUENCES * LENGTH
LOCK = "/tmp/hookscope-heavy.lock"
TRAINERS = {
    "ours": None,
    "saelens": "sae-lens",
    "sparsify": "eai-sparsify",
    "dictionary_learning": "dictionary-learning",
}
VENVS = {"saelens": "saelens", "sparsify": "sparsify", "dictionary_learning": "dictlearn"}
ROOT = Path(__file__).resolve().parents[1]


def write_activations(path: Path) -> None:
    """Record SmolLM2's layer-15 MLP output on the example corpus: (SEQUENCES * LENGTH, WIDTH) float32."""
    sys.path.insert(0, str(ROOT))
    from attribution import record
    from examples._smollm2 import load_smollm2
    from examples.dictionaries_smollm2 import stdlib_text

    model, tokenizer = load_smollm2()
    ids = torch.tensor(tokenizer(stdlib_text(), add_special_tokens=False).input_ids)
    if len(ids) < SEQUENCES * LENGTH:
        raise SystemExit(f"the corpus has {len(ids)} tokens; {SEQUENCES * LENGTH} are needed")
    sequences = ids[: SEQUENCES * LENGTH].reshape(SEQUENCES, LENGTH)
    site, parts = f"model.layers.{LAYER}.mlp", []
    for batch in sequences.split(32):
        with torch.no_grad(), record(model, site) as acts:
            model(batch)
        parts.append(acts[site].reshape(-1, WIDTH).float())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, torch.cat(parts).numpy())
    os.replace(tmp, path)


def dead_after(steps: int) -> int:
    """Tokens without firing after which ours counts a feature dead: max(batch, tokens // 10) here."""
    return max(BATCH, steps * BATCH // 10)


def batches(x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The rows of each step in ours' order: one seeded permutation of the training rows per pass."""
    order, start = [], 0
    while start < steps * BATCH:
        order.append(np.random.default_rng([SEED, len(order)]).permutation(len(x)))
        start += len(x)
    flat = torch.from_numpy(np.concatenate(order)[: steps * BATCH])
    return [x[flat[i * BATCH : (i + 1) * BATCH]] for i in range(steps)]


def _timed(call: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (every thread of the process: the work done, whatever the load) of ``call()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def train_ours(x: torch.Tensor, steps: int, out: Path) -> tuple[float, float]:
    from attribution import SAE, train_dictionary

    sae = SAE(WIDTH, FEATURES, k=K)
    seconds = _timed(lambda: train_dictionary(None, x, None, sae, out=out / "run", tokens=steps * BATCH,
                                              batch_size=BATCH, lr=LR, seed=SEED, checkpoint_every=steps,
                                              progress=False))  # fmt: skip
    sae.save(out / "weights")
    return seconds


def train_saelens(x: torch.Tensor, steps: int, out: Path) -> tuple[float, float]:
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=WIDTH, d_sae=FEATURES, k=K, dtype="float32", device="cpu"))
    cfg = SAETrainerConfig(
        total_training_samples=steps * BATCH, train_batch_size_samples=BATCH, lr=LR, lr_end=LR,
        lr_scheduler_name="constant", device="cpu", dead_feature_window=dead_after(steps) // BATCH,
        feature_sampling_window=steps, n_checkpoints=0, save_final_checkpoint=False,
    )  # fmt: skip
    trainer = SAETrainer(cfg, sae, iter(batches(x, steps)))
    seconds = _timed(trainer.fit)
    sae.fold_W_dec_norm()  # SAELens's own fold (as in its fold_activation_whitening): the same function, unit rows
    sae.cfg.rescale_acts_by_decoder_norm = False
    sae.save_model(out / "weights")
    return seconds


class _RowsModel(torch.nn.Module):
    """The cached rows as a 'model' for sparsify's trainer: token id ``i`` -> activation row ``i``."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.rows = torch.nn.Embedding.from_pretrained(x, freeze=True)

    @property
    def base_model(self) -> torch.nn.Module:
        return self

    @property
    def device(self) -> torch.device:
        return self.rows.weight.device

    @property
    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(1, 1, dtype=torch.long)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids)


def train_sparsify(x: torch.Tensor, steps: int, out: Path) -> tuple[float, float]:
    from datasets import Dataset
    from sparsify import SparseCoderConfig, TrainConfig, Trainer

    index = torch.arange(len(x)).unsqueeze(-1)
    ids = torch.cat([b for b in batches(index, steps)]).reshape(-1, LENGTH)  # the same rows, as 'token ids'
    data = Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    cfg = TrainConfig(
        SparseCoderConfig(num_latents=FEATURES, k=K), batch_size=BATCH // LENGTH, loss_fn="fvu", optimizer="adam",
        lr=LR, lr_warmup_steps=0, auxk_alpha=1 / 32, dead_feature_threshold=dead_after(steps), hookpoints=["rows"],
        init_seeds=[SEED], save_every=10**9, log_to_wandb=False, save_dir=str(out), run_name="run",
    )  # fmt: skip
    trainer = Trainer(cfg, data, _RowsModel(x))
    seconds = _timed(trainer.fit)
    os.replace(out / "run" / "rows", out / "weights")
    return seconds


def train_dictionary_learning(x: torch.Tensor, steps: int, out: Path) -> tuple[float, float]:
    from dictionary_learning.trainers.top_k import TopKTrainer
    from dictionary_learning.training import trainSAE

    config = {
        "trainer": TopKTrainer, "steps": steps, "activation_dim": WIDTH, "dict_size": FEATURES, "k": K,
        "layer": LAYER, "lm_name": "SmolLM2-135M-Instruct", "lr": LR, "warmup_steps": 0, "seed": SEED,
        "device": "cpu",
    }  # fmt: skip
    data = iter(batches(x, steps))
    seconds = _timed(lambda: trainSAE(data, [config], steps, save_dir=str(out / "run"), device="cpu"))
    os.replace(out / "run" / "trainer_0", out / "weights")
    return seconds


def train_one(name: str, work: Path, steps: int, threads: int) -> None:
    """In the trainer's own environment: train, save, print one JSON line with the time and the version."""
    import importlib.metadata

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    x = torch.from_numpy(np.load(work / "activations.npy")[:TRAIN_ROWS]).clone()
    out = work / name
    fn = {"ours": train_ours, "saelens": train_saelens, "sparsify": train_sparsify,
          "dictionary_learning": train_dictionary_learning}[name]  # fmt: skip
    seconds, cpu = fn(x, steps, out)
    package = TRAINERS[name]
    version = importlib.metadata.version(package) if package else _our_version()
    print(json.dumps({"seconds": seconds, "cpu": cpu, "version": version, "torch": torch.__version__}))


def _our_version() -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"hookscope {commit.stdout.strip() or '?'}"


def held_out(path: Path, x: torch.Tensor) -> dict[str, float]:
    """FVU, L0 and dead fraction of the dictionary saved in ``path`` on the held-out rows ``x``."""
    from attribution import load_dictionary

    sae = load_dictionary(path)
    with torch.no_grad():
        f = sae.encode(x)
        x_hat = sae.decode(f)
    error = (x.double() - x_hat.double()).pow(2).sum()
    total = (x.double() - x.double().mean(0)).pow(2).sum()
    return {"fvu": float(error / total), "l0": float((f > 0).sum(-1).float().mean()),
            "dead": float((~(f > 0).any(0)).float().mean())}  # fmt: skip


def run_trainer(name: str, steps: int, threads: int, work: Path, venvs: Path, env: dict[str, str]) -> dict:
    """One fresh training run of ``name`` in its own process under the lock; its times and held-out numbers."""
    python = sys.executable if name == "ours" else str(venvs / VENVS[name] / "bin" / "python")
    if not Path(python).is_file():
        return {"error": f"not installed: {python} is missing"}
    shutil.rmtree(work / name, ignore_errors=True)  # a fresh run (ours would resume a finished one)
    before = Path("/proc/loadavg").read_text().split()[:3]
    run = subprocess.run(["flock", LOCK, python, "-m", "benchmarks.dictionary_peers", "--train", name,
                          "--work", str(work), "--steps", str(steps), "--threads", str(threads)],
                         env=env, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    after = Path("/proc/loadavg").read_text().split()[:3]
    (work / f"{name}.log").write_text(run.stdout + run.stderr)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["(no output)"]
        result = {"error": f"exit {run.returncode}: {tail[0]}"}
    else:
        result = json.loads(lines[-1])
        try:
            result.update(
                held_out(work / name / "weights", torch.from_numpy(np.load(work / "activations.npy"))[TRAIN_ROWS:])
            )
        except Exception as exc:  # a folder our loader cannot read is reported, not hidden
            result["error"] = f"load_dictionary: {type(exc).__name__}: {exc}"
    result["load"] = f"{' '.join(before)} -> {' '.join(after)}"
    return result


def main(steps: int, threads: int, work: Path, venvs: Path, only: list[str], write_inc: bool, rounds: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "SPARSIFY_DISABLE_TRITON": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    here = [sys.executable, "-m", "benchmarks.dictionary_peers"]
    if not (work / "activations.npy").is_file():
        start = time.perf_counter()
        subprocess.run(["flock", LOCK, *here, "--record", "--work", str(work)], env=env, cwd=ROOT, check=True)
        print(f"activations recorded in {time.perf_counter() - start:.0f} s")
    runs: dict[str, list[dict]] = {name: [] for name in only}
    for _ in range(rounds):  # interleaved: every trainer once per round, so that a change of load hits all alike
        for name in only:
            runs[name].append(run_trainer(name, steps, threads, work, venvs, env))
            print(name, json.dumps(runs[name][-1]), flush=True)
    results = {name: _median_of(done) for name, done in runs.items()}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    text = render(results, steps, threads)
    print(text)
    if write_inc:  # or later from the stored results: --from-results --write-inc
        (ROOT / "docs" / "methods" / "dictionaries_peers.inc").write_text(text)


def _median_of(done: list[dict]) -> dict:
    """The last run's numbers with the median wall and CPU seconds of all runs (the held-out ones are the same)."""
    timed = [r for r in done if "seconds" in r]
    if not timed:
        return done[-1]
    result = dict(timed[-1], rounds=len(timed), load="; ".join(r["load"] for r in done))
    for key in ("seconds", "cpu"):
        result[key] = float(np.median([r[key] for r in timed]))
    return result


def render(results: dict[str, dict], steps: int, threads: int) -> str:
    from benchmarks._timing import table

    ours = results.get("ours", {})
    rounds = max((r.get("rounds", 1) for r in results.values()), default=1)
    rows = []
    for name, r in results.items():
        if "seconds" not in r:
            rows.append([name, "-", str(steps), str(BATCH), "-", "-", "-", "-", "-", "-", "-", r.get("error", "?")])
            continue
        rate = steps * BATCH / r["seconds"]
        ratio = f"{ours['seconds'] / r['seconds']:.2f}x" if "seconds" in ours else "-"
        per_cpu = f"{steps * BATCH / r['cpu']:.0f}" if "cpu" in r else "-"
        cpu_ratio = f"{ours['cpu'] / r['cpu']:.2f}x" if "cpu" in r and "cpu" in ours else "-"
        fvu = f"{r['fvu']:.4f}" if "fvu" in r else "-"
        l0 = f"{r['l0']:.1f}" if "l0" in r else "-"
        dead = f"{100 * r['dead']:.1f}%" if "dead" in r else "-"
        row = [name, r["version"], str(steps), str(BATCH), f"{rate:.0f}", ratio, per_cpu, cpu_ratio, fvu, l0, dead,
               r.get("error", "")]  # fmt: skip
        rows.append(row)
    header = (
        f"TopK SAE 576 -> 4608, k = 32, Adam lr 4e-4, {steps} steps x {BATCH} rows of SmolLM2-135M layer-15 MLP "
        f"output; CPU, {threads} threads, torch {torch.__version__}; held-out FVU on 8,192 other rows"
    )
    text = table(["trainer", "version", "steps", "batch", "tokens/s", "speed vs ours", "tokens/CPU-s",
                  "CPU speed vs ours", "held-out FVU", "L0", "dead (held-out)", "note"],
                 rows)  # fmt: skip
    loads = [f"{name} {r['load']}" for name, r in results.items() if "load" in r]
    notes = [
        f"median of {rounds} interleaved runs per trainer (wall and CPU seconds of the training call; CPU seconds",
        "count every thread of the process: the work done, whatever else runs on the machine); load average (1/5/15",
        "min, 2 cores) before -> after each run: " + "; ".join(loads),
        "each peer's own recipe otherwise: SAELens decoder_init_norm 0.1, decoder-norm rescaling, b_dec not started",
        "at the data mean; sparsify eager decoder (SPARSIFY_DISABLE_TRITON=1), lr decaying linearly to 0;",
        "dictionary_learning no AuxK in so short a run (dead after 10M tokens, fixed). See the script's docstring.",
    ]
    body = "\n".join(("   " + line).rstrip() for line in [header, *text.splitlines(), "", *notes])
    return ".. code-block:: text\n\n" + body + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved runs per trainer (medians reported)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hookscope-dictionary-peers"))
    parser.add_argument("--venvs", type=Path, default=Path("/work/venvs"), help="<venvs>/<peer>/bin/python")
    parser.add_argument("--only", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    parser.add_argument("--write-inc", action="store_true", help="write docs/methods/dictionaries_peers.inc")
    parser.add_argument("--from-results", action="store_true", help="only render <work>/results.json (no training)")
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train", choices=list(TRAINERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:
        torch.set_num_threads(args.threads)
        write_activations(args.work / "activations.npy")
    elif args.from_results:
        text = render(json.loads((args.work / "results.json").read_text()), args.steps, args.threads)
        print(text)
        if args.write_inc:
            (ROOT / "docs" / "methods" / "dictionaries_peers.inc").write_text(text)
    elif args.train:
        train_one(args.train, args.work, args.steps, args.threads)
    else:
        main(args.steps, args.threads, args.work, args.venvs, args.only, args.write_inc, args.rounds)
