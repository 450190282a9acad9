"""How faithful are Grad-CAM and Eigen-CAM on a real network? Deletion, insertion, ROAD, pointing, randomisation.

EfficientNet-Lite0 with its ImageNet weights (see gradcam_demo.py) looks at matplotlib's photo of Grace Hopper and,
where scikit-image is installed, at its bundled photo of a coffee cup. For each photo's top class the script
computes the Grad-CAM and the Eigen-CAM of the last feature map, scores both maps with every metric of
``attribution.metrics``, prints a table, and draws the deletion and insertion curves and the randomisation test.
The object boxes of the pointing game were drawn by hand (examples/_photos.py).

Run: python examples/metrics_demo.py [--out out/]
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
from _photos import BOXES, photo

from attribution import EigenCAM, GradCAM
from attribution.metrics import deletion, insertion, pointing_game, randomization_test, road
from attribution.plot import plot_curves, plot_randomization

STAGES = ["classifier", "conv_head", "blocks.6", "blocks.3", "conv_stem"]  # cascading, from the top down


def main(out: Path) -> None:
    torch.set_num_threads(1)  # a second thread gains little here, and costs many-fold on busy cores
    start = time.perf_counter()
    model = load_efficientnet_lite0()
    names = ["grace_hopper"] + (["coffee"] if importlib.util.find_spec("skimage") else [])
    images = torch.stack([preprocess(photo(name)) for name in names])
    with torch.no_grad():
        classes = model(images).argmax(dim=1).tolist()
    categories = imagenet_categories()
    methods = {
        "Grad-CAM": lambda m, x, t: GradCAM(m, "bn2")(x, t),
        "Eigen-CAM": lambda m, x, t: EigenCAM(m, "bn2")(x, t),
    }
    boxes = torch.tensor([BOXES[name] for name in names])
    print(f"EfficientNet-Lite0, layer bn2, on {', '.join(names)}: top classes {[categories[c] for c in classes]}")
    print(f"\n{'method':10s} {'photo':13s} deletion insertion  ROAD  pointing    randomised: Spearman, SSIM")
    print(f"{'':10s} {'':13s}   AUC ↓    AUC ↑    ↑    hit  energy   classifier ↓  all {len(STAGES)} stages ↓")
    curves = {}
    for method, explain in methods.items():
        maps = explain(model, images, classes)
        gone = deletion(model, images, maps, classes, steps=16)
        shown = insertion(model, images, maps, classes, steps=16)
        roads = road(model, images, maps, classes, percentiles=[20, 50, 80])
        points = pointing_game(maps, boxes)
        sanity = randomization_test(explain, model, images, classes, layers=STAGES)
        curves[method] = (gone, shown)
        for i, name in enumerate(names):
            print(
                f"{method:10s} {name:13s} {gone.auc[i]:8.3f} {shown.auc[i]:8.3f} {roads.auc[i]:6.3f} "
                f"{'yes' if points.hit[i] else 'no':>5s} {points.energy[i]:7.2f} {sanity.spearman[0, i]:11.2f} "
                f"{sanity.ssim[-1, i]:14.2f}"
            )
        if method == "Grad-CAM":
            fig = plot_randomization(sanity, images[0], mean=MEAN, std=STD, ncols=7, alpha=0.5)
            fig.savefig(out_dir(out) / "metrics_demo_randomization.png", dpi=90, bbox_inches="tight")
            plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    plot_curves({m: c[0] for m, c in curves.items()}, ax=axes[0], title=f"deletion (zeros), {names[0]}")
    plot_curves({m: c[1] for m, c in curves.items()}, ax=axes[1], title=f"insertion (from the blur), {names[0]}")
    path = out_dir(out) / "metrics_demo_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    grid = path.with_name("metrics_demo_randomization.png")
    print(f"\nwrote {path} and {grid} ({time.perf_counter() - start:.0f} s)")


def out_dir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
