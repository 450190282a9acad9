"""DAS training time per epoch and IIA: hookscope's ``train_intervention`` against pyvene's ``IntervenableModel``.

Run from the repository root with an interpreter that has pyvene (``pip install --no-deps pyvene`` in a venv made
with ``--system-site-packages`` is enough): python -m benchmarks.causal_speed [--epochs 6] [--rounds 3]
[--rst docs/methods/causal_speed.inc]

The model is a GPT-2 with random weights (``N_LAYER`` blocks of width ``WIDTH``, sequences of ``LENGTH`` tokens); the
site is block ``LAYER``'s output at the last position; the counterfactual labels are what the model predicts when
that whole vector is taken from the source run, so a rotation that moves the right ``K`` of its ``WIDTH`` coordinates
reaches them. Both train a ``RotatedSubspace(WIDTH, K)`` (pyvene: ``RotatedSpaceIntervention`` with interchange
dimension ``K``) from the same orthogonal matrix, with Adam at the same learning rate, the same batches in the same
order and cross-entropy on the last position's logits. Reported: CPU time of the process per epoch on one torch
thread (``time.process_time``; the work done, which other jobs on a shared machine disturb less than wall time),
the median over rounds, and the IIA on held-out pairs after training. hookscope records the sources' site once and
runs each step on the base prompts' cached prefix (only the last position); pyvene runs the source and the base
whole at every step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attribution.causal import RotatedSubspace, Site, interchange, interchange_intervention_accuracy, train_intervention
from benchmarks._timing import setup, table

N_LAYER, WIDTH, HEADS, VOCAB, LENGTH = 4, 128, 4, 512, 16
LAYER, K, N_TRAIN, N_TEST, BATCH, LR = 2, 64, 512, 256, 64, 1e-2


def make_model() -> Any:
    """A GPT-2 with random weights (seed 0), in eval mode, float32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=N_LAYER, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=LENGTH)
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config).eval()


def make_task(model: Any, site: Site) -> dict[str, torch.Tensor]:
    """Random base and source prompts; labels: the model's prediction with the site's whole vector from the source."""
    g = torch.Generator().manual_seed(1)
    n = N_TRAIN + N_TEST
    base = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    source = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    full = RotatedSubspace(WIDTH, WIDTH)
    with torch.no_grad():
        labels = interchange(model, base, source, {site: full}).logits[:, -1].argmax(-1)
    return {"base": base, "source": source, "labels": labels}


def orders(epochs: int) -> list[torch.Tensor]:
    """The row order of each epoch, as ``train_intervention`` draws it (seed 0)."""
    return [torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(e)) for e in range(epochs)]


def ours(model: Any, task: dict[str, Any], site: Site, start: torch.Tensor, epochs: int) -> tuple[float, float]:
    """CPU seconds per epoch and held-out IIA for hookscope."""
    intervention = RotatedSubspace(WIDTH, K)
    intervention.rotation = start.clone()
    train = slice(0, N_TRAIN)
    t0 = time.process_time()
    train_intervention(
        model, task["base"][train], task["source"][train], task["labels"][train], intervention, site,
        epochs=epochs, lr=LR, batch_size=BATCH, seed=0,
    )  # fmt: skip
    per_epoch = (time.process_time() - t0) / epochs
    test = slice(N_TRAIN, None)
    iia = interchange_intervention_accuracy(
        model, task["base"][test], task["source"][test], task["labels"][test], intervention, site
    )
    return per_epoch, iia


def pyvene_run(model: Any, task: dict[str, torch.Tensor], start: torch.Tensor, epochs: int) -> tuple[float, float]:
    """CPU seconds per epoch and held-out IIA for pyvene, on the same batches."""
    import pyvene as pv

    config = pv.IntervenableConfig(
        representations=[pv.RepresentationConfig(LAYER, "block_output", "pos", 1)],
        intervention_types=pv.RotatedSpaceIntervention,
    )
    iv = pv.IntervenableModel(config, model)
    iv.set_device("cpu")
    iv.disable_model_gradients()
    (intervention,) = [v[0] if isinstance(v, tuple) else v for v in iv.interventions.values()]
    intervention.set_interchange_dim(K)
    intervention.rotate_layer.weight = start.T.clone()  # pyvene rotates row vectors: its weight is our R^T
    optimizer = torch.optim.Adam(iv.get_trainable_parameters(), lr=LR)
    last = LENGTH - 1

    def logits(rows: Any) -> torch.Tensor:
        b, s = task["base"][rows], task["source"][rows]
        _, out = iv({"input_ids": b}, [{"input_ids": s}], {"sources->base": last})
        return out.logits[:, -1]

    t0 = time.process_time()
    for order in orders(epochs):
        for step in range(-(-N_TRAIN // BATCH)):
            rows = order[step * BATCH : (step + 1) * BATCH]
            loss = F.cross_entropy(logits(rows), task["labels"][rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    per_epoch = (time.process_time() - t0) / epochs
    with torch.no_grad():
        test = torch.arange(N_TRAIN, N_TRAIN + N_TEST)
        predicted = torch.cat([logits(test[i : i + BATCH]).argmax(-1) for i in range(0, N_TEST, BATCH)])
    return per_epoch, (predicted == task["labels"][test]).double().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rst", type=Path, help="also write the table as reStructuredText here")
    args = parser.parse_args()
    setup(threads=1)
    model = make_model()
    site = Site(f"transformer.h.{LAYER}", positions=(LENGTH - 1,))
    task = make_task(model, site)
    start = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(2)))[0]
    times: dict[str, list[float]] = {"hookscope": [], "pyvene": []}
    iia: dict[str, float] = {}
    for r in range(args.rounds):
        runs = [("hookscope", lambda: ours(model, task, site, start, args.epochs))]
        runs.append(("pyvene", lambda: pyvene_run(copy.deepcopy(model), task, start, args.epochs)))
        for name, fn in runs if r % 2 == 0 else runs[::-1]:
            seconds, iia[name] = fn()
            times[name].append(seconds)
    ours_s, theirs_s = statistics.median(times["hookscope"]), statistics.median(times["pyvene"])
    caption = (
        f"GPT-2 random weights, {N_LAYER} blocks of {WIDTH}, {LENGTH} tokens; DAS k={K} at block {LAYER}'s output, "
        f"last position; {N_TRAIN} training pairs in batches of {BATCH}, {args.epochs} epochs, Adam lr {LR}; "
        f"CPU s per epoch on 1 thread, median of {args.rounds} rounds"
    )
    rows = [
        ["hookscope", f"{ours_s:.2f}", f"{iia['hookscope']:.3f}", f"{theirs_s / ours_s:.2f}x"],
        ["pyvene", f"{theirs_s:.2f}", f"{iia['pyvene']:.3f}", "1.00x"],
    ]
    header = ["", "CPU s / epoch", "held-out IIA", "speed vs pyvene"]
    print(caption, table(header, rows), sep="\n")
    if args.rst:
        lines = table(header, rows).splitlines()
        rule = lines[1].replace("-", "=")
        args.rst.write_text("\n".join([caption + ":", "", rule, lines[0], rule, *lines[2:], rule, ""]))


if __name__ == "__main__":
    main()
