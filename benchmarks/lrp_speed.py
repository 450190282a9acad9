"""LRP time on VGG-16 and ResNet-50 (224 x 224, float32, one thread): ours vs zennit 1.0 vs the floor, one process.

Run from the repository root: python -m benchmarks.lrp_speed [--rounds 3] [--batch 4] [--models vgg16 resnet50]
[--composites EpsilonPlus ...] [--no-zennit]
The floor is one forward and backward of the plain model with parameter gradients (``loss.backward()``). Times are
CPU times (``time.process_time``) on one thread, the median of interleaved rounds; ratios are to the floor. zennit
runs with its canonizer for the model (VGG: ``VGGCanonizer``, ResNet: ``ResNetCanonizer``) and the same composite.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from attribution.lrp import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from benchmarks._timing import setup, table

LOW, HIGH = -2.2, 2.7  # the ImageNet-normalised values of pixels 0 and 1, roughly


def cpu_times(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median CPU time of each variant, run in turn (one warm-up each)."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            start = time.process_time()
            variants[name]()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def zennit_calls(model: torch.nn.Module, kind: str, seed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    try:
        from zennit import composites
        from zennit.attribution import Gradient
        from zennit.torchvision import ResNetCanonizer, VGGCanonizer
    except ImportError:
        return {}
    canonizer = ResNetCanonizer if kind == "resnet50" else VGGCanonizer
    made = {
        "EpsilonPlusFlat": lambda: composites.EpsilonPlusFlat(canonizers=[canonizer()]),
        "EpsilonPlus": lambda: composites.EpsilonPlus(canonizers=[canonizer()]),
        "EpsilonAlpha2Beta1": lambda: composites.EpsilonAlpha2Beta1(canonizers=[canonizer()]),
        "EpsilonGammaBox": lambda: composites.EpsilonGammaBox(low=LOW, high=HIGH, canonizers=[canonizer()]),
    }

    def run(make: Callable[[], Any], x: torch.Tensor) -> Any:
        with Gradient(model, make()) as attributor:
            return attributor(x, seed)[1]

    return {name: (lambda x, m=make: run(m, x)) for name, make in made.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
    parser.add_argument("--composites", nargs="+", default=None, help="a subset of the four composites")
    parser.add_argument("--no-zennit", action="store_true", help="leave zennit out")
    args = parser.parse_args()
    setup(1)
    ours = {
        "EpsilonPlusFlat": EpsilonPlusFlat(),
        "EpsilonPlus": EpsilonPlus(),
        "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1(),
        "EpsilonGammaBox": EpsilonGammaBox(LOW, HIGH),
    }
    ours = {name: c for name, c in ours.items() if args.composites is None or name in args.composites}
    rows = []
    targets = list(range(args.batch))
    for kind in args.models:
        model = getattr(torchvision.models, kind)(weights=None).eval()
        x = torch.randn(args.batch, 3, 224, 224)

        def floor(model: torch.nn.Module = model, x: torch.Tensor = x) -> None:
            model.zero_grad(set_to_none=True)
            model(x)[torch.arange(len(targets)), targets].sum().backward()
            model.zero_grad(set_to_none=True)

        def seed(output: torch.Tensor) -> torch.Tensor:
            one_hot = torch.zeros_like(output)
            one_hot[torch.arange(len(targets)), targets] = 1.0
            return one_hot * output

        theirs = {} if args.no_zennit else zennit_calls(model, kind, seed)
        for name, composite in ours.items():
            lrp = LRP(model, composite)
            variants: dict[str, Callable[[], Any]] = {
                "floor": floor,
                "ours": lambda lrp=lrp, x=x: lrp(x, target=targets),
            }
            if name in theirs:
                variants["zennit"] = lambda f=theirs[name], x=x: f(x)
            times = cpu_times(variants, args.rounds)
            base = times["floor"]
            zennit = times.get("zennit")
            rows.append(
                [
                    kind,
                    name,
                    f"{base:.2f}",
                    f"{times['ours']:.2f} ({times['ours'] / base:.2f}x)",
                    "-" if zennit is None else f"{zennit:.2f} ({zennit / base:.2f}x)",
                ]
            )
            print(table(["model", "composite", "floor s", "ours s", "zennit 1.0 s"], rows[-1:]), flush=True)
    print()
    print(f"batch {args.batch}, 224 x 224, float32, 1 thread, CPU time, median of {args.rounds} interleaved rounds")
    print(table(["model", "composite", "floor s", "ours s", "zennit 1.0 s"], rows))


if __name__ == "__main__":
    main()
