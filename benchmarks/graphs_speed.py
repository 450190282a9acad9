"""Attribution graphs on SmolLM2-135M: time, autograd runs and peak memory against one forward + backward.

Run from the repository root: python -m benchmarks.graphs_speed [--tokens 16 64 256] [--nodes 1000 5000]
[--basis neurons transcoders] [--threads 2] [--progress]. ``--progress``: the graph's progress bar on stderr (of a
``--one`` run: how far a long graph got). ``transcoders``: a random TopK transcoder (8 x 576 = 4608 features, k = 32,
with a skip) at every layer's MLP in place of its neurons (the cost of a feature basis; the features mean nothing).
Each (tokens, max_nodes, basis) runs in a fresh process (its peak resident memory is the process's, ``ru_maxrss``, minus
what the loaded model held), the prompt is the first ``tokens`` tokens of a fixed English text, the target the
salient logits (circuit-tracer's default), ``batch_size`` 32, ``edges_per_row`` 4096. The floor: one forward and
one backward of the same prompt (the gradient of the top logit with respect to the input embeddings). ``batch`` and
``batch CPU``: the median wall and CPU (process) time of one batch of rows, the first batch (the logit rows, fewer)
left out; with ``--threads 1`` the CPU time is the work done, whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks._timing import setup, table

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders stopped to rest and to "
    "exchange grain, salt and cloth. Over the centuries the settlement grew into a market town, then into a "
    "walled city with a cathedral, a university and a harbour that sent ships across the sea. Its people were "
    "known for their skill with wool and glass, and for the long festival that closed every harvest, when the "
    "streets were filled with music and the bells of every church rang from dawn until late in the night. "
) * 12  # 1,250 tokens


def _timed_batches(times: list[tuple[float, float]]) -> None:
    """Record ``(wall, CPU)`` seconds of every batch of rows (one backward pass and its kept entries)."""
    from attribution.graphs import _frozen

    rows = _frozen._rows

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        done = rows(*args, **kwargs)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
        return done

    _frozen._rows = timed  # type: ignore[assignment]


def one(
    tokens: int, nodes: int, batch: int, basis: str = "neurons", progress: bool = False, threads: int = 2
) -> dict[str, Any]:
    """Time, runs and memory of one graph (in this process)."""
    sys.path.insert(0, "examples")
    from _smollm2 import load_smollm2

    from attribution import Transcoder, attribution_graph
    from attribution.graphs.build import memory_estimate
    from attribution.models import lm_layout

    setup(threads)
    batches: list[tuple[float, float]] = []
    _timed_batches(batches)
    model, tokenizer = load_smollm2()
    ids = torch.tensor(tokenizer.encode(TEXT, add_special_tokens=False)[:tokens])
    if len(ids) < tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --tokens {tokens}: lengthen TEXT")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    embeds = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
    start = time.perf_counter()
    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, -1]
    torch.autograd.grad(logits.max(), embeds)
    floor = time.perf_counter() - start
    dictionaries: dict[str, Transcoder] | str = "neurons"
    if basis == "transcoders":
        torch.manual_seed(0)
        width = model.config.hidden_size
        dictionaries = {f"model.layers.{i}.mlp": Transcoder(width, width, 8 * width, activation="topk", k=32, skip=True)
                        for i in range(model.config.num_hidden_layers)}  # fmt: skip
    start = time.perf_counter()
    graph = attribution_graph(model, ids, basis=dictionaries, max_nodes=nodes, batch_size=batch, progress=progress)
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    units = len(graph.nodes.where("neuron")) + len(graph.nodes.where("feature"))
    targets = units + len(graph.nodes.where("logit"))
    bound = math.ceil(targets / batch) + 2
    widths = list(graph.units)
    errors = len(graph.nodes.where("error")) // tokens
    estimate = sum(memory_estimate(lm_layout(model), tokens, widths, errors, units, batch, 4096, torch.float32))
    full = batches[1:] or batches  # the first batch (logit rows) is smaller
    return {"tokens": tokens, "nodes": nodes, "basis": basis, "seconds": took, "floor": floor, "runs": graph.runs,
            "batch_s": statistics.median(b[0] for b in full), "batch_cpu_s": statistics.median(b[1] for b in full),
            "bound": bound, "peak_gib": (peak - base) / 2**20, "estimate_gib": estimate / 2**30,
            "edges": graph.adjacency._nnz()}  # fmt: skip


def main(tokens: list[int], nodes: list[int], batch: int, bases: list[str], threads: int) -> None:
    rows = []
    for t in tokens:
        for n in nodes:
            for basis in bases:
                command = [sys.executable, "-m", "benchmarks.graphs_speed", "--one", str(t), str(n), "--batch",
                           str(batch), "--basis", basis, "--threads", str(threads)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:
                    rows.append(
                        [
                            t,
                            n,
                            basis,
                            "failed: " + done.stderr.strip().splitlines()[-1][:60],
                            "",
                            "",
                            "",
                            "",
                            "",
                            "",
                            "",
                        ]
                    )
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                ratio = r["seconds"] / r["floor"]
                rows.append([t, n, basis, f"{r['seconds']:.0f} s", f"{ratio:.0f}x", f"{r['batch_s']:.1f} s",
                             f"{r['batch_cpu_s']:.1f} s", f"{r['runs']} ({r['bound']})",
                             f"{r['peak_gib']:.2f} GiB", f"{r['estimate_gib']:.2f} GiB", r["edges"]])  # fmt: skip
                print(rows[-1], flush=True)
    header = ["tokens", "max_nodes", "basis", "time", "/ fwd+bwd", "batch", "batch CPU", "runs (bound)", "peak memory",
              "estimate", "edges"]  # fmt: skip
    print(table(header, rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--basis", nargs="+", choices=["neurons", "transcoders"], default=["neurons"])
    parser.add_argument("--one", type=int, nargs=2, default=None)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.batch, args.basis[0], args.progress, args.threads)))
    else:
        main(args.tokens, args.nodes, args.batch, args.basis, args.threads)
