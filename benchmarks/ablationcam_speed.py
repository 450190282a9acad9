"""Ablation-CAM time on resnet50 (layer4, 2048 channels), ours vs pytorch-grad-cam's AblationCAM, one process.

Run from the repository root: python -m benchmarks.ablationcam_speed [--rounds 1] [--size 96] [--batch-size 32]
Both ablate ``--batch-size`` channels per forward. pytorch-grad-cam runs the whole network on each batch of ablated
copies (2048 / 32 = 64 forwards of 32 images per image); ours runs the backbone up to layer4 once and only what
follows layer4 (pooling and the classifier) on the copies. Floor: one plain forward under no_grad. The
images are small (96x96 by default) so that pytorch-grad-cam's run stays within minutes on two threads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from attribution import AblationCAM
from benchmarks._timing import interleaved, setup, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    setup(2)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, args.size, args.size)
    ours = AblationCAM(model, "layer4", batch_size=args.batch_size, progress=False)

    def floor() -> Any:
        with torch.no_grad():
            return model(x)

    variants: dict[str, Callable[[], Any]] = {
        "no_grad forward (floor)": floor,
        "hookscope AblationCAM": lambda: ours(x, 3),
    }
    try:
        from pytorch_grad_cam import AblationCAM as PGCAblationCAM
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        pgc = PGCAblationCAM(model=model, target_layers=[model.layer4], batch_size=args.batch_size)
        variants["pytorch-grad-cam 1.5 AblationCAM"] = lambda: pgc(input_tensor=x, targets=[ClassifierOutputTarget(3)])
    except ImportError:
        pass
    times = interleaved(variants, repeats=args.rounds, warmup=0)
    t0, ours_t = times["no_grad forward (floor)"], times["hookscope AblationCAM"]
    rows = [[name, f"{t:.3f}", f"{t / t0:.1f}", f"{t / ours_t:.1f}"] for name, t in times.items()]
    print(f"resnet50, layer4, one {args.size}x{args.size} image, 2 threads; median of {args.rounds}")
    print(table(["method", "s", "x floor", "x hookscope"], rows))


if __name__ == "__main__":
    main()
