"""Metric time against the floor and the peers: deletion + insertion vs torchcam, ROAD vs pytorch-grad-cam, one process.

Run from the repository root: python -m benchmarks.metrics_speed [--rounds 3] [--models resnet50 efficientnet_lite0]
[--statistic min] [--only curves|road] [--rst docs/methods/metrics_speed.inc]

``--only explanations`` times infidelity and sensitivity_max against captum 0.9's instead (CPU time of the process on
one torch thread, ``time.process_time``, so that other jobs on a shared machine disturb it less): resnet18 on
EXPLAINED images of 64x64, N_PERTURB perturbations each, ``batch_size`` (captum's ``max_examples_per_batch``) 40 (all
copies in one forward) and 8 (five chunks). The infidelity floor is the model's forwards on the perturbed copies,
prepared beforehand, plus the unperturbed forward; the sensitivity floor is hookscope's ``Saliency`` on the inputs and
on the prepared noisy copies, in the same chunks. captum's ``sensitivity_max`` is timed with its own ``Saliency`` and
with hookscope's, to separate the metric's work from the method's. Write its table with ``--rst
docs/methods/metrics_explanations_speed.inc``.

Random weights (the time does not depend on them), 2 images of 224x224, smooth maps (7x7 upsampled, like a CAM),
given classes, 2 threads, perturbed images in batches of 32 everywhere. The *floor* is the model's forwards under
``torch.no_grad()`` on the same perturbed images, prepared beforehand and run in the same batches: no
implementation of the metric can take less. hookscope runs one unperturbed forward per call on top; with both
curves in one call (``deletion_insertion``, one baseline) that forward and the all-zeros image are shared, as in
torchcam, and the forwards are as many as the floor's. The variants take turns in each round, so that drift on a
shared machine hits them alike; times are the minimum over the rounds (``--statistic median`` for medians): on a
2-core machine shared with other jobs, the least disturbed run is the best estimate of each variant's own time.
Peers that are not installed are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F
import torchvision

from attribution import Saliency
from attribution.metrics import deletion, deletion_insertion, infidelity, insertion, road, sensitivity_max
from attribution.metrics._impute import noisy_linear_imputation
from attribution.metrics._perturb import make_baseline, pixel_ranks, replace_top, step_counts
from benchmarks._timing import interleaved, setup, table

BATCH, SIZE, STEPS, CHUNK = 2, 224, 20, 32
PERCENTILES = (10, 20, 30, 40, 50, 60, 70, 80, 90)
EXPLAINED, EXPLAINED_SIZE, N_PERTURB = 4, 64, 10


def build(name: str) -> torch.nn.Module:
    if name == "resnet50":
        return torchvision.models.resnet50(weights=None).eval()
    import timm

    return timm.create_model("tf_efficientnet_lite0", pretrained=False).eval()


def forwards(model: torch.nn.Module, images: torch.Tensor) -> Callable[[], Any]:
    """The floor: the model on prepared images, in batches of CHUNK, without autograd."""

    def run() -> Any:
        with torch.no_grad():
            return [model(images[i : i + CHUNK]) for i in range(0, len(images), CHUNK)]

    return run


class GivenMaps:
    """A torchcam CAM extractor returning fixed maps, so that torchcam's metric does only the metric's work."""

    def __init__(self, model: torch.nn.Module, maps: torch.Tensor) -> None:
        self.model, self.maps = model, maps

    def __call__(self, class_idx: object = None, scores: object = None, normalized: bool = True, **kw: object) -> Any:
        return [self.maps]

    def fuse_cams(self, cams: list[torch.Tensor]) -> torch.Tensor:
        return cams[0]

    def _hooks_off(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def curves_variants(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, classes: list[int]) -> dict:
    ranks, counts, zeros = pixel_ranks(maps), step_counts(SIZE * SIZE, STEPS), make_baseline("zeros", x)
    items = torch.arange(BATCH).repeat_interleave(STEPS)
    perturbed = torch.cat(
        [
            replace_top(x, zeros, ranks, items, counts[1:].repeat(BATCH)),  # deletion's points after the first
            replace_top(zeros, x, ranks, items, counts[:-1].repeat(BATCH)),  # insertion's points before the last
        ]
    )
    variants: dict[str, Callable[[], Any]] = {"perturbed forwards (floor)": forwards(model, perturbed)}
    variants["hookscope deletion_insertion (one call)"] = lambda: deletion_insertion(
        model, x, maps, classes, baselines=("zeros", "zeros"), steps=STEPS, batch_size=CHUNK
    )
    variants["hookscope deletion + insertion (two calls)"] = lambda: (
        deletion(model, x, maps, classes, steps=STEPS, batch_size=CHUNK),
        insertion(model, x, maps, classes, steps=STEPS, batch_size=CHUNK, baseline="zeros"),
    )
    try:
        from torchcam.metrics import DeletionInsertionMetric

        def torchcam() -> Any:
            metric = DeletionInsertionMetric(
                GivenMaps(model, maps), functools.partial(torch.softmax, dim=-1), steps=STEPS, batch_size=CHUNK
            )
            metric.update(x, class_idx=classes)
            return metric.summary()

        variants["torchcam 0.5 DeletionInsertionMetric"] = torchcam
    except ImportError:
        pass
    return variants


def road_variants(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, classes: list[int]) -> dict:
    ranks, pixels = pixel_ranks(maps), SIZE * SIZE
    removed = []
    for i in range(BATCH):
        for order in ("morf", "lerf"):
            for q in PERCENTILES:
                k = round(q / 100 * pixels)
                removed.append((ranks[i] < k) if order == "morf" else (ranks[i] >= pixels - k))
    masks = torch.stack(removed).view(-1, SIZE, SIZE)
    sources = x.repeat_interleave(2 * len(PERCENTILES), dim=0)
    imputed = noisy_linear_imputation(sources, masks)

    def impute() -> Any:
        return [
            noisy_linear_imputation(sources[i : i + CHUNK], masks[i : i + CHUNK]) for i in range(0, len(masks), CHUNK)
        ]

    variants: dict[str, Callable[[], Any]] = {
        "imputed forwards (floor)": forwards(model, imputed),
        "hookscope road": lambda: road(model, x, maps, classes, batch_size=CHUNK),
        "  its imputation alone": impute,
    }
    try:
        from pytorch_grad_cam.metrics.road import ROADCombined
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputSoftmaxTarget

        targets = [ClassifierOutputSoftmaxTarget(c) for c in classes]
        cams = maps.numpy()
        combined = ROADCombined(percentiles=list(PERCENTILES))
        variants["pytorch-grad-cam 1.5 ROADCombined"] = lambda: combined(x, cams, targets, model)
    except ImportError:
        pass
    return variants


def gaussian(inputs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Infidelity's local perturbation: ``I ~ N(0, 0.01)``, perturbed input ``x - I``."""
    noise = 0.1 * torch.randn(inputs.shape, generator=generator)
    return noise, inputs - noise


def chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The item-major copies of ``x`` in the chunks both libraries make: ``k = chunk // B`` copies of each item."""
    k = max(chunk // len(x), 1)
    sizes = [k] * (N_PERTURB // k) + ([N_PERTURB % k] if N_PERTURB % k else [])
    return [x.repeat_interleave(size, 0) + 0.01 * torch.randn(len(x) * size, *x.shape[1:]) for size in sizes]


def captum_form(method: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``method`` as captum's sensitivity calls it: a one-tensor tuple in and out (inputs), a tensor (copies)."""

    def call(inputs: Any, target: Any) -> Any:
        return (method(inputs[0], target),) if isinstance(inputs, tuple) else method(inputs, target)

    return call


def explanation_variants(model: torch.nn.Module, x: torch.Tensor, classes: list[int], chunk: int) -> dict:
    from captum.attr import Saliency as CaptumSaliency
    from captum.metrics import infidelity as captum_infidelity
    from captum.metrics import sensitivity_max as captum_sensitivity

    phi, copies, saliency = torch.randn_like(x), chunks(x, chunk), Saliency(model)
    per_copy = [torch.tensor(classes).repeat_interleave(len(c) // len(x)) for c in copies]

    def forwards() -> Any:
        with torch.no_grad():
            return [model(x), *(model(c) for c in copies)]

    def saliencies() -> Any:
        return [saliency(x, classes), *(saliency(c, t) for c, t in zip(copies, per_copy, strict=True))]

    def captum_perturb() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(0)
        return lambda inputs: gaussian(inputs, generator)

    common = {"perturb_radius": 0.02, "n_perturb_samples": N_PERTURB, "max_examples_per_batch": chunk}
    return {
        "infidelity: forwards (floor)": forwards,
        "hookscope infidelity": lambda: infidelity(model, phi, x, gaussian, classes, n=N_PERTURB, batch_size=chunk),
        "captum 0.9 infidelity": lambda: captum_infidelity(
            model, captum_perturb(), x, phi, target=classes, n_perturb_samples=N_PERTURB, max_examples_per_batch=chunk
        ),
        "sensitivity: Saliency calls (floor)": saliencies,
        "hookscope sensitivity_max (Saliency)": lambda: sensitivity_max(
            saliency, x, classes, n=N_PERTURB, batch_size=chunk
        ),
        "captum 0.9 sensitivity_max (captum Saliency)": lambda: captum_sensitivity(
            CaptumSaliency(model).attribute, x, target=classes, **common
        ),
        "captum 0.9 sensitivity_max (hookscope Saliency)": lambda: captum_sensitivity(
            captum_form(saliency), x, target=classes, **common
        ),
    }


def explanation_sections(rounds: int, statistic: Callable[[list[float]], float], label: str) -> list[tuple[str, list]]:
    """Infidelity and sensitivity against captum on one thread, CPU time, for a batch of 40 rows and of 8."""
    import warnings

    warnings.filterwarnings("ignore", message="Input Tensor 0 did not already require gradients")
    setup(1)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(EXPLAINED, 3, EXPLAINED_SIZE, EXPLAINED_SIZE)
    classes = [3, 1, 4, 1][:EXPLAINED]
    sections = []
    for chunk in (40, 8):
        variants = explanation_variants(model, x, classes, chunk)
        load = os.getloadavg()[0]
        times = interleaved(variants, repeats=rounds, statistic=statistic, clock=time.process_time)
        what = f"resnet18, {EXPLAINED} images of {EXPLAINED_SIZE}x{EXPLAINED_SIZE}, n = {N_PERTURB}, batch_size {chunk}"
        print(f"{what}; CPU s, 1 thread; {label} of {rounds}; load average {load:.1f}", flush=True)
        body = explanation_rows(times)
        print(table(["variant", "CPU s", "x floor"], body), "\n", flush=True)
        sections.append((f"**{what}** (CPU time, one thread, {label} of {rounds}, load average {load:.1f}):", body))
    return sections


def explanation_rows(times: dict[str, float]) -> list[list[str]]:
    """Each variant's time and its ratio to the floor of its metric (the row above it that says floor)."""
    out, floor = [], 1.0
    for name, t in times.items():
        floor = t if "floor" in name else floor
        out.append([name, f"{t:.3f}", f"{t / floor:.2f}"])
    return out


def rows(times: dict[str, float]) -> list[list[str]]:
    floor = next(iter(times.values()))
    return [[name, f"{t:.2f}", f"{t / floor:.2f}"] for name, t in times.items()]


def rst(sections: list[tuple[str, list[list[str]]]], header: list[str] | None = None) -> str:
    out = []
    for title, body in sections:
        out += [title, "", ".. list-table::", "   :header-rows: 1", "   :widths: 50 25 25", ""]
        for row in [header or ["variant", "time (s)", "x floor"], *body]:
            out.append(f"   * - {row[0].strip()}")
            out += [f"     - {cell}" for cell in row[1:]]
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["resnet50", "efficientnet_lite0"])
    parser.add_argument("--rst", type=Path, help="also write the tables as reStructuredText here")
    parser.add_argument("--statistic", choices=["min", "median"], default="min", help="of the rounds' times")
    parser.add_argument(
        "--only", choices=["curves", "road", "explanations"], help="time only deletion + insertion, ROAD, or infidelity"
    )
    args = parser.parse_args()
    if args.only == "explanations":
        sections = explanation_sections(args.rounds, min if args.statistic == "min" else median, args.statistic)
        if args.rst:
            args.rst.write_text(rst(sections, ["variant", "CPU time (s)", "x floor"]))
        return
    setup(2)
    sections = []
    for name in args.models:
        model = build(name)
        x = torch.randn(BATCH, 3, SIZE, SIZE)
        maps = F.interpolate(torch.rand(BATCH, 1, 7, 7), size=(SIZE, SIZE), mode="bilinear")[:, 0]
        classes = list(range(BATCH))
        sets = {
            "curves": (f"deletion + insertion, {STEPS} steps each", curves_variants),
            "road": (f"ROAD, {len(PERCENTILES)} percentiles, MoRF and LeRF", road_variants),
        }
        for key, (what, make) in sets.items():
            if args.only not in (None, key):
                continue
            variants = make(model, x, maps, classes)
            load = os.getloadavg()[0]
            times = interleaved(variants, repeats=args.rounds, statistic=min if args.statistic == "min" else median)
            title = f"{name}, {what}; {BATCH} images; {args.statistic} of {args.rounds}; load average {load:.1f} before"
            print(title, f"and {os.getloadavg()[0]:.1f} after", flush=True)
            print(table(["variant", "s", "x floor"], rows(times)), "\n", flush=True)
            sections.append(
                (f"**{name}**, {what} ({args.statistic} of {args.rounds}, load average {load:.1f}):", rows(times))
            )
    if args.rst:
        args.rst.write_text(rst(sections))


if __name__ == "__main__":
    main()
