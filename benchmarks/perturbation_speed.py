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
   stride (3, 28, 28) (49 windows): captum ``Occlusion`` at its default ``perturbations_per_eval=1`` and at the best
   of 7, 16 and 49, against ours (``perturbations_per_forward`` from the memory budget). Floor: the 50 forwards of
   one image at a time.

3. The same model, one prompt per call as captum runs it, on one thread: token FeatureAblation of three prompts of
   14 to 19 tokens (:data:`PROMPTS`), target the top next token, baseline token 0. Reported: CPU time
   (``time.process_time``, the work done, steady on a shared machine where wall time swings 3x), wall time, and per
   prompt the model calls and the token positions they ran (rows times positions, counted at the embedding).

Float32, 2 threads (part 3: one); each variant timed once per round, rounds interleaved (benchmarks/_timing.py);
each variant keeps its result, and the largest difference from captum's is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision

from attribution import FeatureAblation, Occlusion, ShapleyValueSampling
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


def resnet(rounds: int) -> list[list[Any]]:
    from captum.attr import Occlusion as CaptumOcclusion

    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    window, stride = (3, 56, 56), (3, 28, 28)

    def theirs(per_eval: int) -> torch.Tensor:
        return CaptumOcclusion(model).attribute(
            x, sliding_window_shapes=window, strides=stride, target=3, perturbations_per_eval=per_eval
        )

    def floor() -> None:
        with torch.no_grad():
            for _ in range(50):
                model(x)

    variants = {f"captum Occlusion, perturbations_per_eval={n}": (lambda n=n: theirs(n)) for n in (1, 7, 16, 49)}
    variants["hookscope Occlusion"] = lambda: Occlusion(model, window, stride)(x, target=3)
    variants["floor: 50 forwards of one image"] = floor
    results: dict[str, Any] = {}
    times = interleaved(kept(variants, results), repeats=rounds, warmup=1)
    best = min((n for n in variants if n.startswith("captum")), key=times.__getitem__)
    reference = results["captum Occlusion, perturbations_per_eval=1"]
    rows = []
    for name in variants:
        error = "" if results[name] is None else f"{(results[name] - reference).abs().max().item():.1e}"
        rows.append([name, f"{times[name]:.2f}", f"{times[best] / times[name]:.2f}", error])
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
        title = "resnet50 (random weights), 1 x 3 x 224 x 224, Occlusion window (3, 56, 56), stride (3, 28, 28)"
        parts.append((title, ["variant", "s", "x captum's best", "max abs diff vs captum"], resnet(args.rounds)))
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
