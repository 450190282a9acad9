"""Draws docs/gallery/lrp_efficientnet.png: LRP heatmaps of EfficientNet-Lite0 on two photos, per composite.

Run from the repository root: python docs/_tools/make_lrp.py
For each photo, the relevance of the network's top class is summed over the colour channels and shown with a
diverging colour map centred at 0 (red: for the class, blue: against), scaled per map to its 99.5th percentile of
absolute values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from _efficientnet_lite0 import MEAN, STD, imagenet_categories, load_efficientnet_lite0, preprocess  # noqa: E402
from _photos import photo  # noqa: E402

from attribution.lrp import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat  # noqa: E402

PHOTOS = ("grace_hopper", "chelsea", "coffee")


def main() -> None:
    torch.set_num_threads(2)
    model = load_efficientnet_lite0()
    low = torch.tensor([(0.0 - m) / s for m, s in zip(MEAN, STD, strict=True)]).view(1, 3, 1, 1)
    high = torch.tensor([(1.0 - m) / s for m, s in zip(MEAN, STD, strict=True)]).view(1, 3, 1, 1)
    composites = {
        "EpsilonPlusFlat": EpsilonPlusFlat(),
        "EpsilonPlus": EpsilonPlus(),
        "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1(),
        "EpsilonGammaBox": EpsilonGammaBox(low, high),
    }
    images = torch.stack([preprocess(photo(name)) for name in PHOTOS])
    with torch.no_grad():
        top = model(images).argmax(1)
    categories = imagenet_categories()
    fig, axes = plt.subplots(len(PHOTOS), 1 + len(composites), figsize=(2.2 * (1 + len(composites)), 2.3 * len(PHOTOS)))
    for i in range(len(PHOTOS)):
        shown = (images[i] * torch.tensor(STD)[:, None, None] + torch.tensor(MEAN)[:, None, None]).clamp(0, 1)
        axes[i, 0].imshow(shown.permute(1, 2, 0).numpy())
        axes[i, 0].set_title(categories[int(top[i])], fontsize=9)
    for j, (name, composite) in enumerate(composites.items(), start=1):
        relevance = LRP(model, composite)(images, target=top).sum(1)
        for i in range(len(PHOTOS)):
            heat = relevance[i].numpy()
            scale = float(np.percentile(np.abs(heat), 99.5)) or 1.0
            axes[i, j].imshow(heat, cmap="bwr", vmin=-scale, vmax=scale)
            if i == 0:
                axes[i, j].set_title(name, fontsize=9)
    for ax in axes.flat:
        ax.set_axis_off()
    fig.tight_layout()
    out = ROOT / "docs" / "gallery" / "lrp_efficientnet.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    from PIL import Image

    with Image.open(out) as image:  # a 256-colour palette, as make_gallery.py's shrink(): under 300 KB
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(out, optimize=True)
    print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
