"""Perturbation attributions on a real network and a real language model: no gradients, only forwards.

1. EfficientNet-Lite0 with its ImageNet weights (see gradcam_demo.py) on ``--photos`` bundled photos (Grace Hopper,
   and with scikit-image its cat and coffee cup), each for its top class: Occlusion (a 48 x 48 window, stride 24),
   RISE (``--masks`` masks of a 7 x 7 grid) and KernelSHAP on superpixels (SLIC where scikit-image is installed,
   else a 8 x 8 grid of squares; ``--coalitions`` coalitions), scored with the deletion and insertion curves of
   ``attribution.metrics`` (area under the curve of the class probability: lower is better for deletion, higher for
   insertion). Occlusion and KernelSHAP are drawn on a symmetric scale (red raises the class's logit, blue lowers
   it); RISE's map, positive everywhere, on its own range from its smallest to its largest value.
2. SmolLM2-135M-Instruct on ``--prompts`` of the 20 IOI prompts (``When Mary and John went to the store, John gave a
   drink to``): token FeatureAblation and ShapleyValueSampling (``--samples`` permutations) of the log-probability
   of the indirect object, with the unperturbed prefix's keys/values reused (``reuse=True``, the default) and
   without: time, model calls and token positions run, and the largest difference between the two (float
   rounding). Skipped where the weights are not installed (see examples/_smollm2.py).

Run: python examples/perturbation_demo.py [--out out/] [--photos 3] [--masks 200] [--coalitions 150] [--prompts 20]
[--samples 2]
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
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).parent))
from _efficientnet_lite0 import imagenet_categories, load_efficientnet_lite0, preprocess
from _photos import photo

from attribution import RISE, FeatureAblation, KernelSHAP, Occlusion, ShapleyValueSampling
from attribution.metrics import deletion, insertion
from attribution.plot import to_rgb

UNITS = {  # what a map's value is, in the class's logit
    "Occlusion": "logit - logit occluded",
    "RISE": "mean logit, pixel kept",
    "KernelSHAP (superpixels)": "Shapley value (logit)",
}


def superpixels(image: torch.Tensor) -> torch.Tensor:
    """About 50 SLIC superpixels of a preprocessed ``(3, H, W)`` image (ids 0..M-1), else an 8 x 8 grid."""
    h, w = image.shape[-2:]
    if importlib.util.find_spec("skimage") is None:
        return (torch.arange(h)[:, None] * 8 // h * 8 + torch.arange(w)[None] * 8 // w)[None]
    from skimage.segmentation import slic

    segments = slic(image.permute(1, 2, 0).double().numpy(), n_segments=50, compactness=10, start_label=0)
    return torch.unique(torch.from_numpy(segments), return_inverse=True)[1][None]


def draw_maps(images: torch.Tensor, labels: list[str], maps: dict[str, torch.Tensor]) -> Figure:
    """One row per photo: the photo, then each method's map with a colour bar in the target's logit units."""
    rows, cols = len(labels), 1 + len(maps)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False, layout="constrained")
    for row, label in enumerate(labels):
        axes[row, 0].imshow(to_rgb(images[row], mean=(0.5,) * 3, std=(0.5,) * 3))
        axes[row, 0].set_title(label, fontsize=10)
        for col, (method, attributions) in enumerate(maps.items(), 1):
            heat = attributions[row].mean(0)
            if method == "RISE":  # positive everywhere: its own range, else the map is one flat colour
                shown = axes[row, col].imshow(
                    heat.numpy(), cmap="inferno", vmin=float(heat.min()), vmax=float(heat.max())
                )
            else:  # symmetric: red raises the class's logit, blue lowers it
                bound = float(heat.abs().max()) or 1.0
                shown = axes[row, col].imshow(heat.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound)
            axes[row, col].set_title(method, fontsize=10)
            bar = fig.colorbar(shown, ax=axes[row, col], fraction=0.046, pad=0.03)
            bar.ax.tick_params(labelsize=8)
            bar.set_label(UNITS.get(method, "logit"), fontsize=8)
    for ax in axes.flat:
        ax.axis("off")
    return fig


def images_part(out: Path, photos: int, masks: int, coalitions: int) -> None:
    model = load_efficientnet_lite0()
    names = ["grace_hopper", "chelsea", "coffee"] if importlib.util.find_spec("skimage") else ["grace_hopper"]
    names = names[:photos]
    images = torch.stack([preprocess(photo(name)) for name in names])
    with torch.no_grad():
        classes = model(images).argmax(dim=1)
    categories = imagenet_categories()
    methods = {
        "Occlusion": lambda: Occlusion(model, (3, 48, 48), (3, 24, 24))(images, classes),
        "RISE": lambda: RISE(model, masks=masks, cell=7)(images, classes),
        "KernelSHAP (superpixels)": lambda: torch.cat(
            [
                KernelSHAP(model, superpixels(image), samples=coalitions)(image[None], c)
                for image, c in zip(images, classes, strict=True)
            ]
        ),
    }
    maps, took = {}, {}
    for method, run in methods.items():
        start = time.perf_counter()
        maps[method] = run()
        took[method] = time.perf_counter() - start
    fig = draw_maps(images, [f"{name}: {categories[c]}" for name, c in zip(names, classes, strict=True)], maps)
    fig.savefig(out / "perturbation_maps.png", dpi=80)
    plt.close(fig)
    seconds = ", ".join(f"{method} {t:.0f} s" for method, t in took.items())
    print(f"EfficientNet-Lite0 on {len(names)} photos ({seconds}); mean AUC of the class probability")
    print("| method | deletion (lower is better) | insertion (higher is better) |\n|---|---|---|")
    for method, attributions in maps.items():
        pixels = attributions.mean(1)
        low = deletion(model, images, pixels, classes, steps=25).auc.mean()
        high = insertion(model, images, pixels, classes, steps=25).auc.mean()
        print(f"| {method} | {low:.3f} | {high:.3f} |")


def language_part(prompts: int, samples: int) -> None:
    try:
        from _smollm2 import ioi_prompts, load_smollm2
    except ModuleNotFoundError as exc:
        print(f"\nSmolLM2 part skipped: {exc}")
        return
    model, tokenizer = load_smollm2()
    ioi = ioi_prompts(tokenizer)
    ids, answers = ioi.clean[:prompts], ioi.io[:prompts]
    positions = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, a: positions.append(a[0].numel()))
    print(f"\nSmolLM2-135M, {len(ids)} IOI prompts of {ids.shape[1]} tokens: log p(indirect object)")
    print("| method | reuse | s | model calls | token positions run |\n|---|---|---|---|---|")
    try:
        for name, build in (
            ("FeatureAblation", lambda reuse: FeatureAblation(model, reuse=reuse)),
            ("ShapleyValueSampling", lambda reuse: ShapleyValueSampling(model, samples=samples, reuse=reuse)),
        ):
            results = []
            for reuse in (True, False):
                method, positions[:] = build(reuse), []
                start = time.perf_counter()
                results.append(method(ids, answers))
                took = time.perf_counter() - start
                print(f"| {name} | {reuse} | {took:.1f} | {method.forwards} | {sum(positions)} |")
            print(f"|   max difference | | {(results[0] - results[1]).abs().max():.1e} | | |")
    finally:
        hook.remove()
    top = results[0].mean(0)
    print("mean ShapleyValueSampling per position: " + ", ".join(f"{v:+.2f}" for v in top.tolist()))


def main(out: Path, photos: int, masks: int, coalitions: int, prompts: int, samples: int, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    images_part(out, photos, masks, coalitions)
    language_part(prompts, samples)
    print(f"\nwrote {out}/perturbation_maps.png ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--photos", type=int, default=3)
    parser.add_argument("--masks", type=int, default=200)
    parser.add_argument("--coalitions", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main(args.out, args.photos, args.masks, args.coalitions, args.prompts, args.samples, args.threads)
