"""Grad-CAM time and memory on resnet50 (layer4), ours vs pytorch-grad-cam, torchcam and captum, one process.

Run from the repository root: python -m benchmarks.gradcam_speed [--rounds 5] [--batches 1 8]
Floor: a plain forward under torch.no_grad(). Peak memory counts the tensor storages a call creates (forward and
backward), kept memory those still alive after the call while its result is held (see benchmarks/_timing.py).
Peers that are not installed are left out of the table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from attribution import GradCAM
from benchmarks._timing import interleaved, memory, setup, table


def peers(model: torch.nn.Module, targets: list[int]) -> dict[str, Callable[[torch.Tensor], Any]]:
    calls: dict[str, Callable[[torch.Tensor], Any]] = {}
    try:
        from pytorch_grad_cam import GradCAM as PGC
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        pgc = PGC(model=model, target_layers=[model.layer4])
        calls["pytorch-grad-cam 1.5"] = lambda x: pgc(
            input_tensor=x, targets=[ClassifierOutputTarget(t) for t in targets]
        )
    except ImportError:
        pass
    try:
        from torchcam.methods import GradCAM as TorchCamGradCAM

        def torchcam(x: torch.Tensor) -> Any:
            with TorchCamGradCAM(model, "layer4") as extractor:
                scores = model(x)
                return extractor(class_idx=targets, scores=scores)

        calls["torchcam 0.5"] = torchcam
    except ImportError:
        pass
    try:
        from captum.attr import LayerAttribution, LayerGradCam

        lgc = LayerGradCam(model, model.layer4)

        def captum(x: torch.Tensor) -> Any:
            attr = lgc.attribute(x, target=targets, relu_attributions=True)
            return LayerAttribution.interpolate(attr, tuple(x.shape[-2:]), "bilinear")

        calls["captum 0.9"] = captum
    except ImportError:
        pass
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    setup(2)
    model = torchvision.models.resnet50(weights=None).eval()
    ours = GradCAM(model, "layer4")
    for batch in args.batches:
        x = torch.randn(batch, 3, 224, 224)
        targets = list(range(batch))

        def floor(x: torch.Tensor = x) -> Any:
            with torch.no_grad():
                return model(x)

        variants: dict[str, Callable[[torch.Tensor], Any]] = {"no_grad forward (floor)": floor}
        variants["hookscope GradCAM"] = lambda x, t=targets: ours(x, t)
        variants.update(peers(model, targets))
        times = interleaved({name: (lambda f=f, x=x: f(x)) for name, f in variants.items()}, repeats=args.rounds)
        mem = {name: memory(lambda f=f, x=x: f(x)) for name, f in variants.items()}
        t0, (m0, _) = times["no_grad forward (floor)"], mem["no_grad forward (floor)"]
        rows = [
            [
                name,
                f"{times[name]:.3f}",
                f"{times[name] / t0:.2f}",
                f"{mem[name][0]:.0f}",
                f"{mem[name][0] / m0:.2f}",
                f"{mem[name][1]:.0f}",
            ]
            for name in variants
        ]
        print(f"resnet50, layer4, batch {batch}, 224x224, 2 threads; median of {args.rounds} (time), one run (memory)")
        print(table(["method", "s", "x floor", "peak MiB", "x floor", "kept MiB"], rows))
        print()


if __name__ == "__main__":
    main()
