"""Gradient attributions on a real network, side by side, and the Adebayo et al. sanity check.

EfficientNet-Lite0 with its ImageNet weights (see gradcam_demo.py) looks at matplotlib's photo of Grace Hopper and,
where scikit-image is installed, at its bundled photos of a cat, a coffee cup, an astronaut and a rocket. For each
photo's top class the script draws Saliency, Input x Gradient, Integrated Gradients, SmoothGrad, Guided Backprop,
Deconvolution, Grad-CAM and Guided Grad-CAM side by side, then runs the model randomisation test of Adebayo et al.
(2018, https://arxiv.org/abs/1810.03292) with ``attribution.metrics.randomization_test``: the classifier and then
deeper and deeper blocks are re-initialised (cascading), and each method's map on the randomised network is compared
with its map on the trained one (Spearman rank correlation; 1 = the same map). A map that stays the same while the
network's weights are destroyed does not explain what the network learned: the paper found that Saliency and
Grad-CAM pass (their maps change), Guided Backprop and Guided Grad-CAM fail (their maps barely change).

Pixel maps are shown, and compared, as the absolute attribution summed over the colour channels.

Run: python examples/gradients_demo.py [--out out/] [--photos N] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _efficientnet_lite0 import MEAN, STD, imagenet_categories, load_efficientnet_lite0, preprocess
from _photos import PHOTOS, photo

from attribution import (
    Deconvolution,
    GradCAM,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)
from attribution.metrics import randomization_test
from attribution.plot import to_rgb

LAYER = "bn2"  # the last feature map (its BatchNormAct2d includes the ReLU6), as in gradcam_demo.py
# From the output down. The batch norms outside the blocks (bn2, bn1) are stages of their own: left trained after the
# layer before them is re-initialised, their shift cuts every ReLU6 and all gradients vanish (NaN correlations).
STAGES = ["classifier", "bn2", "conv_head", "blocks.6", "blocks.3", "bn1", "conv_stem"]


def pixels(attributions: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` attributions as ``(B, H, W)`` maps: the absolute value summed over channels."""
    return attributions.abs().sum(dim=1)


def methods() -> dict:
    """Every method as ``(model, images, classes) -> (B, H, W)`` maps, built on the model it is given."""
    return {
        "Saliency": lambda m, x, t: pixels(Saliency(m)(x, t)),
        "Input x Gradient": lambda m, x, t: pixels(InputXGradient(m)(x, t)),
        "Integrated Gradients": lambda m, x, t: pixels(IntegratedGradients(m, steps=16, internal_batch_size=24)(x, t)),
        "SmoothGrad": lambda m, x, t: pixels(SmoothGrad(Saliency(m), samples=8, noise=0.15, seed=0)(x, t)),
        "Guided Backprop": lambda m, x, t: pixels(GuidedBackprop(m)(x, t)),
        "Deconvolution": lambda m, x, t: pixels(Deconvolution(m)(x, t)),
        "Grad-CAM": lambda m, x, t: GradCAM(m, LAYER)(x, t),
        "Guided Grad-CAM": lambda m, x, t: pixels(GuidedGradCAM(m, LAYER)(x, t)),
    }


SANITY = ["Saliency", "Guided Backprop", "Grad-CAM", "Guided Grad-CAM"]


def clipped(m: torch.Tensor) -> torch.Tensor:
    """A map scaled to [0, 1] for display, clipped at its 99th percentile (a few pixels would dominate)."""
    top = torch.quantile(m.flatten().float(), 0.99).clamp(min=1e-12)
    return (m / top).clamp(max=1.0)


def side_by_side(images: torch.Tensor, maps: dict[str, torch.Tensor], labels: list[str], path: Path) -> None:
    rows, cols = images.shape[0], len(maps) + 1
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.7 * rows), squeeze=False, layout="constrained")
    for i in range(rows):
        axes[i, 0].imshow(to_rgb(images[i], mean=MEAN, std=STD))
        axes[i, 0].set_title(labels[i], fontsize=7)
        for j, (name, m) in enumerate(maps.items(), start=1):
            axes[i, j].imshow(clipped(m[i]).numpy(), cmap="inferno", vmin=0, vmax=1)
            if i == 0:
                axes[i, j].set_title(name, fontsize=7)
    for ax in axes.flat:
        ax.set_axis_off()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def sanity_plot(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.2), layout="constrained")
    for name, result in results.items():
        ax.plot(range(len(STAGES)), result.spearman.mean(dim=1).numpy(), marker="o", label=name)
    ax.set_xticks(range(len(STAGES)), [f"+{s}" for s in STAGES], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("Spearman with the trained map")
    ax.set_xlabel("cascading randomisation, from the output down")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_ylim(-0.2, 1.0)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(out: Path, photos: int | None = None, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model = load_efficientnet_lite0()
    names = (list(PHOTOS) if importlib.util.find_spec("skimage") else ["grace_hopper"])[:photos]
    images = torch.stack([preprocess(photo(name)) for name in names])
    with torch.no_grad():
        classes = model(images).argmax(dim=1).tolist()
    categories = imagenet_categories()
    labels = [f"{n}: {categories[c]}" for n, c in zip(names, classes, strict=True)]
    every = methods()
    shown_items = slice(0, 3)  # three photos in the picture; all of them in the sanity check
    maps = {name: explain(model, images[shown_items], classes[shown_items]) for name, explain in every.items()}
    side_by_side(images[shown_items], maps, labels[shown_items], out / "gradients_side_by_side.png")
    shown = time.perf_counter()
    results = {name: randomization_test(every[name], model, images, classes, layers=STAGES) for name in SANITY}
    sanity_plot(results, out / "gradients_sanity.png")
    print(f"EfficientNet-Lite0 on {len(names)} photos: mean Spearman with the trained map, cascading randomisation")
    print("| method | " + " | ".join(f"+{s}" for s in STAGES) + " |")
    print("|---" * (len(STAGES) + 1) + "|")
    for name, result in results.items():
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in result.spearman.mean(dim=1).tolist()) + " |")
    took = time.perf_counter() - start
    print(f"\nwrote {out}/gradients_side_by_side.png, gradients_sanity.png ({took:.0f} s; maps {shown - start:.0f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--photos", type=int, default=None, help="the first N photos (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main(args.out, args.photos, args.threads)
