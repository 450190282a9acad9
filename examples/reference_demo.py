"""Reference-based attributions on a real network, and how well DeepLIFT's attributions add up there.

EfficientNet-Lite0 with its ImageNet weights (see gradcam_demo.py) looks at matplotlib's photo of Grace Hopper and,
where scikit-image is installed, at its bundled photos of a cat and a coffee cup. For each photo's top class the
script draws DeepLift (from a black image), DeepLiftShap and GradientShap (both over four references: black, white,
grey and the photo blurred) side by side, and prints DeepLIFT's summation-to-delta on this network: the share of
``f(x) - f(black)`` that the attributions miss, ``|delta| / |f(x) - f(black)|``. EfficientNet-Lite0's activations
are ReLU6 (inside timm's BatchNormAct2d): hookscope's DeepLift gives them the Rescale rule, captum's has no rule
for ReLU6 and takes its gradient, so its attributions do not add up; where captum is installed, its number is
printed beside ours.

Pixel maps are shown as the absolute attribution summed over the colour channels.

Run: python examples/reference_demo.py [--out out/]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torchvision.transforms.functional as TF
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).parent))
from _efficientnet_lite0 import MEAN, STD, imagenet_categories, load_efficientnet_lite0, preprocess
from _photos import photo

from attribution import DeepLift, DeepLiftShap, GradientShap
from attribution.plot import to_rgb

BLACK, WHITE, GREY = -1.0, 1.0, 0.0  # in the model's input space: (pixel - 0.5) / 0.5
SAMPLES = 8  # GradientShap's random draws per photo (a reference, a point on the path, noise)


def references(image: torch.Tensor) -> torch.Tensor:
    """Black, white, grey and the photo blurred: ``(4, 3, H, W)``."""
    blurred = TF.gaussian_blur(image, kernel_size=51, sigma=20.0)
    return torch.stack([torch.full_like(image, BLACK), torch.full_like(image, WHITE), torch.zeros_like(image), blurred])


def titles(references: int, samples: int) -> tuple[str, str, str]:
    """The maps' titles, every number with its unit: DeepLift, DeepLiftShap, GradientShap."""
    return (
        "DeepLift\nfrom black",
        f"DeepLiftShap\n{references} references",
        f"GradientShap\n{references} references, {samples} samples",
    )


def pixels(attributions: torch.Tensor) -> torch.Tensor:
    return attributions.abs().sum(dim=1)


def clipped(m: torch.Tensor) -> torch.Tensor:
    top = torch.quantile(m.flatten().float(), 0.99).clamp(min=1e-12)
    return (m / top).clamp(max=1.0)


def side_by_side(images: torch.Tensor, maps: dict[str, torch.Tensor], labels: list[str]) -> Figure:
    """One row per photo: the photo, then each method's map; one colour bar for all maps (each clipped at 1)."""
    rows, cols = images.shape[0], len(maps) + 1
    fig, axes = plt.subplots(rows, cols, figsize=(2.5 * cols + 0.6, 2.6 * rows), squeeze=False, layout="constrained")
    for i in range(rows):
        axes[i, 0].imshow(to_rgb(images[i], mean=MEAN, std=STD))
        axes[i, 0].set_title(labels[i], fontsize=9)
        for j, (name, m) in enumerate(maps.items(), start=1):
            shown = axes[i, j].imshow(clipped(m[i]).numpy(), cmap="inferno", vmin=0, vmax=1)
            if i == 0:
                axes[i, j].set_title(name, fontsize=9)
    for ax in axes.flat:
        ax.set_axis_off()
    bar = fig.colorbar(shown, ax=axes[:, 1:], fraction=0.03, pad=0.02)
    bar.set_label("|attribution| summed over RGB, / its 99th percentile", fontsize=8)
    bar.ax.tick_params(labelsize=8)
    return fig


def captum_miss(model: torch.nn.Module, images: torch.Tensor, classes: list[int], gain: torch.Tensor) -> str:
    """captum's ``|delta| / |f(x) - f(black)|`` per photo, or why it is not shown."""
    if importlib.util.find_spec("captum") is None:
        return "captum not installed"
    from captum.attr import DeepLift as CaptumDeepLift

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, delta = CaptumDeepLift(model).attribute(
            images, torch.full_like(images, BLACK), target=classes, return_convergence_delta=True
        )
    return ", ".join(f"{v:.1%}" for v in (delta.abs() / gain.abs()).tolist())


def main(out: Path, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model = load_efficientnet_lite0()
    names = ["grace_hopper", "chelsea", "coffee"] if importlib.util.find_spec("skimage") else ["grace_hopper"]
    images = torch.stack([preprocess(photo(name)) for name in names])
    with torch.no_grad():
        classes = model(images).argmax(dim=1).tolist()
    categories = imagenet_categories()
    labels = [f"{n}: {categories[c]}" for n, c in zip(names, classes, strict=True)]
    attributions, delta = DeepLift(model, BLACK)(images, classes, return_delta=True)
    gain = attributions.flatten(1).sum(1) - delta
    deeplift, deeplift_shap, gradient_shap = titles(len(references(images[0])), SAMPLES)
    maps = {deeplift: pixels(attributions)}
    shap = [DeepLiftShap(model, references(img))(img[None], [c]) for img, c in zip(images, classes, strict=True)]
    maps[deeplift_shap] = pixels(torch.cat(shap))
    grad_shap = [
        GradientShap(model, references(img), samples=SAMPLES, stdevs=0.1)(img[None], [c])
        for img, c in zip(images, classes, strict=True)
    ]
    maps[gradient_shap] = pixels(torch.cat(grad_shap))
    fig = side_by_side(images, maps, labels)
    fig.savefig(out / "reference_side_by_side.png", dpi=80)
    plt.close(fig)
    took = time.perf_counter() - start
    ours = ", ".join(f"{v:.1e}" for v in (delta.abs() / gain.abs()).tolist())
    print(f"EfficientNet-Lite0, DeepLift from black, |delta| / |f(x) - f(black)| per photo ({', '.join(names)}):")
    print(f"  hookscope: {ours}")
    print(f"  captum:    {captum_miss(model, images, classes, gain)}")
    print(f"\nwrote {out}/reference_side_by_side.png ({took:.0f} s without captum)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main(args.out, args.threads)
