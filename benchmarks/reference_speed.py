"""DeepLift and GradientShap time on VGG-11, ours vs captum, one process, with the ratio to the floor.

Run from the repository root: python -m benchmarks.reference_speed [--rounds 3] [--batch 4] [--size 112]
Floor: one forward and backward (the input's gradient, no parameter gradients) of as many rows as the method runs:
``2 * batch`` for DeepLift (inputs and baselines), ``batch * samples`` for GradientShap. VGG-11 because captum's
DeepLift refuses torchvision's ResNets (their ReLU modules run twice per block). GradientShap is compared with
captum's ``GradientShap`` at the same number of samples (its own draws).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from attribution import DeepLift, GradientShap
from benchmarks._timing import interleaved, setup, table

SAMPLES = 5


def floor(model: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        leaf = rows.detach().requires_grad_(True)
        return torch.autograd.grad(model(leaf).gather(1, targets[:, None]).sum(), leaf)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=112)
    args = parser.parse_args()
    setup(2)
    warnings.simplefilter("ignore")  # captum warns about its hooks at every call
    model = torchvision.models.vgg11(weights=None).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(args.batch, 3, args.size, args.size)
    refs = torch.randn(8, 3, args.size, args.size) * 0.1
    targets = torch.arange(args.batch)
    variants: dict[str, Callable[[], Any]] = {
        f"floor: forward + backward, {2 * args.batch} rows": floor(model, torch.cat([x, x]), targets.repeat(2)),
        "hookscope DeepLift": lambda: DeepLift(model)(x, targets),
        f"floor: forward + backward, {SAMPLES * args.batch} rows": floor(
            model, x.repeat(SAMPLES, 1, 1, 1), targets.repeat(SAMPLES)
        ),
        "hookscope GradientShap": lambda: GradientShap(model, refs, samples=SAMPLES)(x, targets),
    }
    try:
        from captum.attr import DeepLift as CaptumDeepLift
        from captum.attr import GradientShap as CaptumGradientShap

        variants["captum 0.9 DeepLift"] = lambda: CaptumDeepLift(model).attribute(x, target=targets)
        variants["captum 0.9 GradientShap"] = lambda: CaptumGradientShap(model).attribute(
            x, refs, n_samples=SAMPLES, target=targets
        )
    except ImportError:
        pass
    times = interleaved(variants, repeats=args.rounds)
    names = list(variants)
    floors = {"DeepLift": times[names[0]], "GradientShap": times[names[2]]}
    rows = []
    for name, t in times.items():
        method = "DeepLift" if "DeepLift" in name else "GradientShap" if "GradientShap" in name else None
        ratio = f"{t / floors[method]:.2f}" if method else "1.00"
        ours = times.get(f"hookscope {method}")
        versus = f"{t / ours:.2f}" if method and ours else ""
        rows.append([name, f"{t:.3f}", ratio, versus])
    print(f"vgg11, batch {args.batch}, {args.size}x{args.size}, 2 threads; median of {args.rounds}")
    print(table(["variant", "s", "x floor", "x hookscope"], rows))


if __name__ == "__main__":
    main()
