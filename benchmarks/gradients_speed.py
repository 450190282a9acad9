"""Gradient attributions: time and peak memory of each method, ours vs captum, on one model and batch, one process.

Run from the repository root: python -m benchmarks.gradients_speed [--rounds 3] [--batch 2] [--size 112]
Model: torchvision resnet18 (random weights, eval), float32, 2 threads. Floors: one forward + backward to the input
(``torch.autograd.grad``), and for Integrated Gradients the same over its 50 steps in batches of 10 steps. Peak
memory counts the tensor storages a call creates (see benchmarks/_timing.py). Each row's method and options are
the same on both sides: IG with 50 Gauss-Legendre steps and internal batches of ``10 * batch`` rows, SmoothGrad of
Saliency with 10 samples, Guided Grad-CAM at ``layer3``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from attribution import (
    Deconvolution,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)
from benchmarks._timing import interleaved, memory, setup, table

STEPS, STEPS_PER_BATCH, SAMPLES = 50, 10, 10


def floors(model: torch.nn.Module, targets: torch.Tensor) -> dict[str, Callable[[torch.Tensor], Any]]:
    def once(x: torch.Tensor) -> Any:
        x = x.detach().requires_grad_()
        out = model(x)
        return torch.autograd.grad(out.gather(1, targets[: len(x), None]).sum(), x)[0]

    def ig_floor(x: torch.Tensor) -> Any:
        rows = x.repeat(STEPS_PER_BATCH, 1, 1, 1)
        tiled = targets.repeat(STEPS_PER_BATCH)
        for _ in range(STEPS // STEPS_PER_BATCH):
            r = rows.detach().requires_grad_()
            torch.autograd.grad(model(r).gather(1, tiled[:, None]).sum(), r)

    return {"floor: forward + backward": once, f"floor: {STEPS} steps in batches": ig_floor}


def methods(model: torch.nn.Module, targets: torch.Tensor, batch: int) -> dict[str, tuple[Callable, Callable | None]]:
    """Each method as (ours, captum's) callables ``x -> attributions``."""
    rows = STEPS_PER_BATCH * batch
    ours: dict[str, Callable[[torch.Tensor], Any]] = {
        "Saliency": lambda x: Saliency(model)(x, targets),
        "InputXGradient": lambda x: InputXGradient(model)(x, targets),
        "IntegratedGradients": lambda x: IntegratedGradients(model, STEPS, internal_batch_size=rows)(x, targets),
        "SmoothGrad(Saliency)": lambda x: SmoothGrad(Saliency(model), SAMPLES, 0.15, seed=0)(x, targets),
        "GuidedBackprop": lambda x: GuidedBackprop(model)(x, targets),
        "Deconvolution": lambda x: Deconvolution(model)(x, targets),
        "GuidedGradCAM": lambda x: GuidedGradCAM(model, "layer3")(x, targets),
    }
    theirs: dict[str, Callable[[torch.Tensor], Any] | None] = dict.fromkeys(ours)
    try:
        from captum import attr

        def tunnel(x: torch.Tensor) -> Any:
            stdev = 0.15 * float(x.max() - x.min())
            return attr.NoiseTunnel(attr.Saliency(model)).attribute(
                x, nt_type="smoothgrad", nt_samples=SAMPLES, stdevs=stdev, target=targets
            )

        theirs = {
            "Saliency": lambda x: attr.Saliency(model).attribute(x, target=targets),
            "InputXGradient": lambda x: attr.InputXGradient(model).attribute(x, target=targets),
            "IntegratedGradients": lambda x: attr.IntegratedGradients(model).attribute(
                x, target=targets, n_steps=STEPS, internal_batch_size=rows
            ),
            "SmoothGrad(Saliency)": tunnel,
            "GuidedBackprop": lambda x: attr.GuidedBackprop(model).attribute(x, target=targets),
            "Deconvolution": lambda x: attr.Deconvolution(model).attribute(x, target=targets),
            "GuidedGradCAM": lambda x: attr.GuidedGradCam(model, model.layer3).attribute(x, target=targets),
        }
    except ImportError:
        pass
    return {name: (ours[name], theirs[name]) for name in ours}


def _bound(f: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: f(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=112)
    args = parser.parse_args()
    setup(2)
    warnings.simplefilter("ignore")  # captum's notes about hooks and requires_grad, once per call
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(args.batch, 3, args.size, args.size)
    targets = torch.arange(args.batch)
    variants: dict[str, Callable[[torch.Tensor], Any]] = dict(floors(model, targets))
    for name, (ours, theirs) in methods(model, targets, args.batch).items():
        variants[f"{name} (hookscope)"] = ours
        if theirs is not None:
            variants[f"{name} (captum 0.9)"] = theirs
    calls = {name: _bound(f, x) for name, f in variants.items()}
    times = interleaved(calls, repeats=args.rounds)
    mem = {name: memory(call)[0] for name, call in calls.items()}
    t0, m0 = times["floor: forward + backward"], mem["floor: forward + backward"]
    rows = [[n, f"{times[n]:.3f}", f"{times[n] / t0:.2f}", f"{mem[n]:.0f}", f"{mem[n] / m0:.2f}"] for n in variants]
    print(
        f"resnet18, batch {args.batch}, {args.size}x{args.size}, float32, 2 threads; median of {args.rounds} "
        "(time), one run (memory)"
    )
    print(table(["method", "s", "x floor", "peak MiB", "x floor"], rows))


if __name__ == "__main__":
    main()
