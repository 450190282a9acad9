"""Perturbation attributions: time of ours vs captum 0.9, with the same settings and equal results, one process.

Run from the repository root: python -m benchmarks.perturbation_speed [--rounds 1] [--samples 3] [--captum-prompts 5]
[--skip-smollm2] [--skip-resnet] [--write-inc]. With the defaults (one round, 3 permutations, captum on 5 prompts,
the windows below) it took 2.6 minutes on 2 threads of a shared 2-core machine at a load of about 2; with captum
on all 20 prompts it took 31 minutes, 22 of them captum's ShapleyValueSampling (860 forwards of one prompt).
``--write-inc`` writes the tables, with the load average before and after, to docs/methods/perturbation_speed.inc.

1. SmolLM2-135M-Instruct (examples/_smollm2.py; skipped if its weights are not installed), the 20 IOI prompts of
   14 tokens, target: the log-probability of the indirect object's token after the prompt. Token FeatureAblation
   and ShapleyValueSampling (``--samples`` permutations) with token 0 as the baseline: captum's ``LLMAttribution``
   (one prompt at a time, one perturbation per forward, the whole prompt re-run each time; on the first
   ``--captum-prompts`` prompts, its time scaled to the 20, as it is linear in their number) against ours on the 20
   prompts at once, with the unperturbed prefix's keys/values reused (``reuse=True``) and without (``reuse=False``);
   FeatureAblation also with 5 perturbations per forward (3 calls instead of 1, where reuse cuts positions).
   Floor: one plain forward of the 20 prompts per perturbation batch is not a fair floor here; the ratio to captum is
   the figure.
2. torchvision resnet50 (random weights, eval), one 224 x 224 image, Occlusion with a (3, 56, 56) window and
   stride (3, 28, 28) (49 windows). First the FLOP bound (:func:`occlusion_flops`): per stage, 49 full forwards
   against the incremental plan (each window's box per node, and with the boxes of a group widened to one size);
   with the clean forward on both sides the plan does 2.02x less work window by window and 1.82x less in groups of
   6 (layer4 is nearly whole for every window: its receptive field covers the image). Then the time, on 1 and on 2
   threads, CPU (``time.process_time``) and wall time, median of interleaved rounds: captum ``Occlusion`` at
   ``perturbations_per_eval`` 1, 7, 16 and 49, ours with full forwards (``incremental=False``, the default) and
   with ``incremental=True`` (groups of windows from the memory budget: 6 here). Measured (CPU s, load 1.9): captum's
   best (7 per eval) 6.85 s on 1 thread and 9.03 s on 2, ours incremental 4.37 s (1.57x) and 5.46 s (1.65x); at a
   load of 2.5 to 3.2, 1.42x on 1 thread. The tables: docs/methods/perturbation_speed.inc.

3. The same model, one prompt per call as captum runs it, on one thread: token FeatureAblation of three prompts of
   14 to 19 tokens (:data:`PROMPTS`), target the top next token, baseline token 0. Reported: CPU time
   (``time.process_time``, the work done, steady on a shared machine where wall time swings 3x), wall time, and per
   prompt the model calls and the token positions they ran (rows times positions, counted at the embedding).

4. A small CNN (conv 3->16, ReLU, max pool, conv 16->32, ReLU, max pool, linear 2048->64, ReLU, linear 64->10;
   random weights, eval), 8 images of 3 x 32 x 32, NeuronFeatureAblation of one unit of the second ReLU (``"4"``)
   and of the first (``"1"``) over 4 x 4 patches (64 features, shared by the channels), baseline 0: captum's
   ``NeuronFeatureAblation`` at ``perturbations_per_eval=1`` (its default) and 16 against ours (from the memory
   budget, each forward stopped at the layer). One thread; CPU time (``time.process_time``), median of the rounds.

Float32, 2 threads (part 2: 1 and 2; parts 3 and 4: one); each variant timed once per round, rounds interleaved
(benchmarks/_timing.py); each variant keeps its result, and the largest difference from captum's is reported.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision

from attribution import FeatureAblation, NeuronFeatureAblation, Occlusion, ShapleyValueSampling
from benchmarks._timing import interleaved, setup, table


def kept(variants: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The variants, each keeping its last result in ``results``."""

    def keep(name: str, fn: Any) -> Any:
        return lambda: results.__setitem__(name, fn())

    return {name: keep(name, fn) for name, fn in variants.items()}


def smollm2(samples: int, rounds: int, captum_prompts: int) -> list[list[Any]]:
    try:
        from captum.attr import FeatureAblation as CaptumFA
        from captum.attr import LLMAttribution, TextTokenInput
        from captum.attr import ShapleyValueSampling as CaptumSVS

        from examples._smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        print(f"SmolLM2 part skipped: {exc}")
        return []
    model, tokenizer = load_smollm2()
    ioi = ioi_prompts(tokenizer)
    ids, answers = ioi.clean, ioi.io
    assert torch.equal(tokenizer.encode(ioi.texts[0], return_tensors="pt")[0], ids[0]), "captum would see other ids"

    def captum(kind: type, **options: Any) -> torch.Tensor:
        rows = []
        for text, answer in zip(ioi.texts[:captum_prompts], answers[:captum_prompts], strict=True):
            if kind is CaptumSVS:
                torch.manual_seed(0)
            llm = LLMAttribution(kind(model), tokenizer)
            result = llm.attribute(TextTokenInput(text, tokenizer, baselines=0), target=answer[None], **options)
            rows.append(result.seq_attr)
        return torch.stack(rows)

    variants = {
        "FeatureAblation, captum LLMAttribution": lambda: captum(CaptumFA),
        "FeatureAblation, hookscope reuse=False": lambda: FeatureAblation(model, baseline=0, reuse=False)(ids, answers),
        "FeatureAblation, hookscope": lambda: FeatureAblation(model, baseline=0)(ids, answers),
        "FeatureAblation, hookscope reuse=False, 5 per forward": lambda: FeatureAblation(
            model, baseline=0, reuse=False, perturbations_per_forward=5
        )(ids, answers),
        "FeatureAblation, hookscope, 5 per forward": lambda: FeatureAblation(
            model, baseline=0, perturbations_per_forward=5
        )(ids, answers),
        "ShapleyValueSampling, captum LLMAttribution": lambda: captum(CaptumSVS, n_samples=samples),
        "ShapleyValueSampling, hookscope reuse=False": lambda: ShapleyValueSampling(
            model, baseline=0, samples=samples, reuse=False
        )(ids, answers),
        "ShapleyValueSampling, hookscope": lambda: ShapleyValueSampling(model, baseline=0, samples=samples)(
            ids, answers
        ),
    }
    results: dict[str, Any] = {}
    times = interleaved(kept(variants, results), repeats=rounds, warmup=0)  # no warm-up: each runs for seconds
    scale = len(ids) / captum_prompts  # captum runs prompt after prompt: its time scales with their number
    rows = []
    for method in ("FeatureAblation", "ShapleyValueSampling"):
        reference = results[f"{method}, captum LLMAttribution"]
        base = times[f"{method}, captum LLMAttribution"] * scale
        for name in [n for n in variants if n.startswith(method)]:
            error = (results[name][:captum_prompts].double() - reference.double()).abs().max().item()
            seconds = times[name] * (scale if "captum" in name else 1)
            label = f"{name} ({captum_prompts} prompts, time x{scale:g})" if "captum" in name and scale != 1 else name
            rows.append([label, f"{seconds:.2f}", f"{base / seconds:.1f}", f"{error:.1e}"])
    return rows


PROMPTS = (
    "The capital of France is a city called Paris, and the capital of Germany is a city called",
    "When Mary and John went to the store, John gave a drink to",
    "In the morning the old fisherman walked down to the harbour and pushed his small boat into the",
)


def smollm2_per_prompt(rounds: int) -> list[list[Any]]:
    """Part 3: one prompt per call, one thread; CPU time, wall time, calls and positions per prompt."""
    try:
        from captum.attr import FeatureAblation as CaptumFA
        from captum.attr import LLMAttribution, TextTokenInput

        from examples._smollm2 import load_smollm2
    except ModuleNotFoundError as exc:
        print(f"SmolLM2 per-prompt part skipped: {exc}")
        return []
    model, tokenizer = load_smollm2()
    prompts = [tokenizer.encode(text, return_tensors="pt") for text in PROMPTS]
    with torch.no_grad():
        tops = [model(x).logits[0, -1].argmax()[None] for x in prompts]
    counts = [0, 0]  # calls, positions

    def count(module: Any, args: Any) -> None:
        counts[0], counts[1] = counts[0] + 1, counts[1] + args[0].numel()

    def captum() -> torch.Tensor:
        rows = []
        for text, top in zip(PROMPTS, tops, strict=True):
            llm = LLMAttribution(CaptumFA(model), tokenizer)
            rows.append(llm.attribute(TextTokenInput(text, tokenizer, baselines=0), target=top).seq_attr)
        return torch.cat(rows)

    def ours(**options: Any) -> Any:
        return lambda: torch.cat(
            [FeatureAblation(model, baseline=0, **options)(x, top)[0] for x, top in zip(prompts, tops, strict=True)]
        )

    variants = {"captum LLMAttribution": captum, "hookscope reuse=False": ours(reuse=False), "hookscope": ours()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    handle = model.get_input_embeddings().register_forward_pre_hook(count)
    try:
        measured = {name: [] for name in variants}
        for r in range(rounds):
            for name in list(variants)[r % 3 :] + list(variants)[: r % 3]:
                counts[:] = [0, 0]
                cpu, wall = time.process_time(), time.perf_counter()
                result = variants[name]()
                measured[name].append((time.process_time() - cpu, time.perf_counter() - wall, *counts, result))
    finally:
        handle.remove()
        torch.set_num_threads(threads)
    reference = measured["captum LLMAttribution"][-1][-1]
    base = statistics.median(m[0] for m in measured["captum LLMAttribution"])
    rows = []
    for name, runs in measured.items():
        cpu, wall = statistics.median(m[0] for m in runs), statistics.median(m[1] for m in runs)
        calls, positions, result = runs[-1][2] / len(prompts), runs[-1][3] / len(prompts), runs[-1][4]
        error = (result.double() - reference.double()).abs().max().item()
        rows.append(
            [name, f"{cpu:.2f}", f"{wall:.2f}", f"{base / cpu:.2f}", f"{calls:.1f}", f"{positions:.0f}", f"{error:.1e}"]
        )
    return rows


WINDOW, STRIDE = (3, 56, 56), (3, 28, 28)


def occlusion_flops(group: int) -> list[list[Any]]:
    """Part 2's bound: resnet50's FLOPs per stage, 49 full forwards against the incremental plan (all windows).

    A node's FLOPs on a box are its full FLOPs (``torch.utils.flop_counter``: convolutions and the linear layer,
    two per multiply-add; elementwise ops count 0) times the box's share of its output's area. ``exact``: each
    window alone; ``groups``: windows in groups of ``group`` (row-major), each box widened to its group's largest.
    The clean forward (one for captum too) is added to both sides of the bound.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from attribution.perturbation._boxes import FULL, equal_sizes, group_plan
    from attribution.perturbation._incremental import IncrementalRunner, trace

    model = torchvision.models.resnet50(weights=None).eval()
    graph = trace(model)
    assert not isinstance(graph, str)
    with torch.no_grad():
        runner = IncrementalRunner(graph, torch.randn(1, 3, 224, 224))
        interpreter, flops = torch.fx.Interpreter(graph), {}
        for node in runner.nodes[:-1]:
            with FlopCounterMode(display=False) as counter:
                interpreter.env[node] = runner.clean[node] if node.op == "placeholder" else interpreter.run_node(node)
            flops[node] = counter.get_total_flops()
    starts = range(0, 224 - 56 + 1, 28)
    windows = [((a, a + 56), (b, b + 56)) for a in starts for b in starts]

    def planned(groups: list[list[Any]]) -> dict[str, float]:
        per_stage: dict[str, float] = {}
        for members in groups:
            boxes = equal_sizes(members, (224, 224))
            assert boxes is not None
            for node, step in group_plan(runner.nodes, runner.kinds, runner.sizes, boxes).items():
                if step is None or not flops.get(node):
                    continue
                area = runner.sizes[node][0] * runner.sizes[node][1] if step != FULL else 1
                share = len(members) if step == FULL else sum((b - a) * (d - c) / area for (a, b), (c, d) in step)
                stage = _stage(node)
                per_stage[stage] = per_stage.get(stage, 0.0) + flops[node] * share
        return per_stage

    exact = planned([[w] for w in windows])
    grouped = planned([windows[i : i + group] for i in range(0, len(windows), group)])
    full = {}
    for node, count in flops.items():
        full[_stage(node)] = full.get(_stage(node), 0.0) + count * len(windows)
    rows = []
    for stage in full:
        ratio = full[stage] / exact.get(stage, 1e-9)
        rows.append(
            [
                stage,
                f"{full[stage] / 1e9:.1f}",
                f"{exact.get(stage, 0) / 1e9:.1f}",
                f"{grouped.get(stage, 0) / 1e9:.1f}",
                f"{ratio:.2f}",
            ]
        )
    one = sum(full.values()) / len(windows)
    total = [sum(full.values()) + one, sum(exact.values()) + one, sum(grouped.values()) + one]
    rows.append(["all + the clean forward", *(f"{t / 1e9:.1f}" for t in total), f"{total[0] / total[1]:.2f}"])
    rows.append(["bound (x, 50 forwards / plan)", "", f"{total[0] / total[1]:.2f}", f"{total[0] / total[2]:.2f}", ""])
    return rows


def _stage(node: Any) -> str:
    name = str(node.target) if node.op == "call_module" else node.name
    if name.startswith("layer"):
        return name.split(".")[0]
    return "head" if name in ("avgpool", "flatten", "fc") else "stem"


def resnet(rounds: int, threads: int) -> list[list[Any]]:
    """Part 2 on ``threads`` torch threads: CPU and wall time, median of interleaved rounds."""
    from captum.attr import Occlusion as CaptumOcclusion

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)

    def theirs(per_eval: int) -> torch.Tensor:
        return CaptumOcclusion(model).attribute(
            x, sliding_window_shapes=WINDOW, strides=STRIDE, target=3, perturbations_per_eval=per_eval
        )

    variants: dict[str, Any] = {f"captum, perturbations_per_eval={n}": (lambda n=n: theirs(n)) for n in (1, 7, 16, 49)}
    variants["hookscope, full forwards (incremental=False)"] = lambda: Occlusion(
        model, WINDOW, STRIDE, show_progress=False
    )(x, target=3)
    variants["hookscope, incremental=True"] = lambda: Occlusion(
        model, WINDOW, STRIDE, show_progress=False, incremental=True
    )(x, target=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured = _clocks(variants, rounds)
    finally:
        torch.set_num_threads(before)
    cpu = {name: statistics.median(m[0] for m in runs) for name, runs in measured.items()}
    wall = {name: statistics.median(m[1] for m in runs) for name, runs in measured.items()}
    best = min((n for n in variants if n.startswith("captum")), key=cpu.__getitem__)
    reference = measured["captum, perturbations_per_eval=1"][-1][2]
    rows = []
    for name, runs in measured.items():
        error = (runs[-1][2] - reference).abs().max().item()
        rows.append([name, f"{cpu[name]:.2f}", f"{wall[name]:.2f}", f"{cpu[best] / cpu[name]:.2f}", f"{error:.1e}"])
    return rows


def _clocks(variants: dict[str, Any], rounds: int) -> dict[str, list[tuple[float, float, Any]]]:
    """Per variant ``(CPU s, wall s, result)`` of each round; one warm-up call each, rounds interleaved."""
    for fn in variants.values():
        fn()
    measured: dict[str, list[tuple[float, float, Any]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            cpu, wall = time.process_time(), time.perf_counter()
            result = variants[name]()
            measured[name].append((time.process_time() - cpu, time.perf_counter() - wall, result))
    return measured


def small_cnn_neuron(rounds: int) -> list[list[Any]]:
    """Part 4: NeuronFeatureAblation on a small CNN, one thread, CPU time."""
    from captum.attr import NeuronFeatureAblation as CaptumNFA

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    ).eval()
    x = torch.randn(8, 3, 32, 32)
    mask = (torch.arange(32)[:, None] // 4 * 8 + torch.arange(32)[None, :] // 4)[None, None]  # 64 patches of 4 x 4
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for layer, neuron in (("4", (5, 7, 9)), ("1", (3, 12, 20))):
            module = dict(model.named_modules())[layer]
            variants = {
                f"captum, layer {layer}, perturbations_per_eval={n}": (
                    lambda n=n, module=module, neuron=neuron: CaptumNFA(model, module).attribute(
                        x, neuron, feature_mask=mask, perturbations_per_eval=n
                    )
                )
                for n in (1, 16)
            }
            variants[f"hookscope, layer {layer}"] = lambda layer=layer, neuron=neuron: NeuronFeatureAblation(
                model, layer, feature_mask=mask[0]
            )(x, neuron)
            results: dict[str, Any] = {}
            times = interleaved(kept(variants, results), repeats=rounds, warmup=1, clock=time.process_time)
            names = list(variants)
            reference, base = results[names[0]], times[names[0]]
            for name in names:
                error = (results[name] - reference).abs().max().item()
                rows.append([name, f"{times[name] * 1e3:.1f}", f"{base / times[name]:.2f}", f"{error:.1e}"])
    finally:
        torch.set_num_threads(threads)
    return rows


def rst(header: list[str], rows: list[list[Any]]) -> str:
    """A reStructuredText simple table."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([rule, line(cells[0]), rule, *map(line, cells[1:]), rule])


def load() -> str:
    """The 1-minute load average."""
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--captum-prompts", type=int, default=5, help="prompts captum runs (its time is scaled)")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--skip-per-prompt", action="store_true", help="skip part 3 (one prompt per call, 1 thread)")
    parser.add_argument("--skip-resnet", action="store_true")
    parser.add_argument("--group", type=int, default=6, help="windows per group in part 2's FLOP table")
    parser.add_argument("--skip-neuron", action="store_true", help="skip part 4 (NeuronFeatureAblation, small CNN)")
    parser.add_argument("--write-inc", action="store_true", help="write docs/methods/perturbation_speed.inc")
    args = parser.parse_args()
    setup(2)
    warnings.simplefilter("ignore")
    before, parts = load(), []
    if not args.skip_smollm2:
        rows = smollm2(args.samples, args.rounds, args.captum_prompts)
        if rows:
            title = (
                "SmolLM2-135M-Instruct, the 20 IOI prompts of 14 tokens, log-probability of the indirect object, "
                f"baseline token 0; ShapleyValueSampling with {args.samples} permutations"
            )
            parts.append((title, ["variant", "s", "x captum", "max abs diff vs captum"], rows))
    if not args.skip_per_prompt:
        rows = smollm2_per_prompt(max(args.rounds, 3))
        if rows:
            title = (
                "SmolLM2-135M-Instruct, token FeatureAblation of 3 prompts of 19, 14 and 18 tokens, one prompt per "
                "call, 1 thread, target the top next token, baseline token 0; median of 3 rounds"
            )
            header = [
                "variant",
                "CPU s",
                "wall s",
                "x captum (CPU)",
                "calls / prompt",
                "positions / prompt",
                "max abs diff",
            ]
            parts.append((title, header, rows))
    if not args.skip_resnet:
        title = (
            "resnet50 (random weights), GFLOPs of Occlusion with window (3, 56, 56), stride (3, 28, 28), 49 windows: "
            f"49 full forwards, the incremental plan window by window and in groups of {args.group}"
        )
        header = ["stage", "49 full", "incremental", f"groups of {args.group}", "full / incremental"]
        parts.append((title, header, occlusion_flops(args.group)))
        for threads in (1, 2):
            title = (
                f"resnet50 (random weights), 1 x 3 x 224 x 224, Occlusion window (3, 56, 56), stride (3, 28, 28), "
                f"{threads} thread(s), median of {max(args.rounds, 3)} interleaved rounds"
            )
            header = ["variant", "CPU s", "wall s", "x captum's best (CPU)", "max abs diff vs captum"]
            parts.append((title, header, resnet(max(args.rounds, 3), threads)))
    if not args.skip_neuron:
        title = (
            "small CNN, 8 x 3 x 32 x 32, NeuronFeatureAblation over 64 patches of 4 x 4, one thread, CPU time, "
            f"median of {max(args.rounds, 5)} rounds"
        )
        header = ["variant", "CPU ms", "x captum (ppe=1)", "max abs diff"]
        parts.append((title, header, small_cnn_neuron(max(args.rounds, 5))))
    after = load()
    for title, header, rows in parts:
        print(f"\n{title}\n{table(header, rows)}")
    print(f"\nload average (1 min): {before} before, {after} after")
    if args.write_inc:
        text = "".join(f"{title}:\n\n{rst(header, rows)}\n\n" for title, header, rows in parts)
        text += (
            f"torch {torch.__version__}, float32, 2 threads, {args.rounds} round(s); load average (1 min) {before} "
            f"before and {after} after the run, on a 2-core machine shared with other jobs.\n"
        )
        Path("docs/methods/perturbation_speed.inc").write_text(text)


if __name__ == "__main__":
    main()
