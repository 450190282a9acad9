"""Does EfficientNet-Lite0 use "stripes" to call a cat a tabby? TCAV with significance, layer by layer.

The inputs are 16 random crops (and mirror images) of scikit-image's cat photo, the target the class the model gives
the whole photo. Three concepts are drawn, 24 images each: **stripes** (sine gratings of random orientation, period
and colours), **dots** (random discs on a plain ground) and **grey** (smooth grey noise, a concept that should mean
nothing to a cat class). The random counterexamples are random crops of the four other bundled photos (Grace Hopper,
a cup of coffee, an astronaut, a rocket). For each layer TCAV learns a CAV per concept against ``--runs`` random sets,
and tests its sign counts against random-vs-random CAVs (two-sided t-test, Bonferroni over concepts and layers).

Run: ``python3 examples/concepts_demo.py`` (timm and the EfficientNet-Lite0 weights; see ``examples/_photos.py``);
writes ``out/concepts_demo.png``. The probes half of the issue's "real use" (SmolLM2, selectivity next to the causal
check) is ``examples/probes_ioi.py``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from _efficientnet_lite0 import imagenet_categories, preprocess
from _photos import PHOTOS, photo
from torchvision.transforms import v2

from attribution import TCAV
from attribution.datasets import load_efficientnet_lite0

LAYERS = ["blocks.2", "blocks.4", "blocks.5", "conv_head"]
SIZE = 224


def stripes(n: int, g: torch.Generator) -> torch.Tensor:
    """Sine gratings: random orientation, period 8-40 px, two random colours."""
    yy, xx = torch.meshgrid(torch.arange(float(SIZE)), torch.arange(float(SIZE)), indexing="ij")
    out = []
    for _ in range(n):
        angle, period = torch.rand(1, generator=g) * math.pi, 8 + 32 * torch.rand(1, generator=g)
        wave = (torch.sin((xx * angle.cos() + yy * angle.sin()) * 2 * math.pi / period) + 1) / 2
        a, b = torch.rand(3, 1, 1, generator=g), torch.rand(3, 1, 1, generator=g)
        out.append(a * wave + b * (1 - wave))
    return torch.stack(out)


def dots(n: int, g: torch.Generator) -> torch.Tensor:
    """20-60 discs of radius 4-16 px in one colour on a plain ground of another."""
    yy, xx = torch.meshgrid(torch.arange(float(SIZE)), torch.arange(float(SIZE)), indexing="ij")
    out = []
    for _ in range(n):
        mask = torch.zeros(SIZE, SIZE)
        for _ in range(int(torch.randint(20, 60, (1,), generator=g))):
            cy, cx = torch.rand(2, generator=g) * SIZE
            radius = 4 + 12 * torch.rand(1, generator=g)
            mask = torch.maximum(mask, (((yy - cy) ** 2 + (xx - cx) ** 2) < radius**2).float())
        a, b = torch.rand(3, 1, 1, generator=g), torch.rand(3, 1, 1, generator=g)
        out.append(a * mask + b * (1 - mask))
    return torch.stack(out)


def grey(n: int, g: torch.Generator) -> torch.Tensor:
    """Smooth grey noise: 7x7 random values upsampled, the same on the three channels."""
    small = torch.rand(n, 1, 7, 7, generator=g)
    return torch.nn.functional.interpolate(small, size=SIZE, mode="bilinear").expand(n, 3, SIZE, SIZE).clone()


def crops(names: list[str], n: int, scale: tuple[float, float], seed: int) -> torch.Tensor:
    """``n`` random resized crops (and mirror images) of the named photos, preprocessed as the model expects."""
    torch.manual_seed(seed)
    augment = v2.Compose([v2.RandomResizedCrop(256, scale=scale), v2.RandomHorizontalFlip()])
    images = [photo(names[i % len(names)]) for i in range(n)]
    return torch.stack([preprocess(augment(image)) for image in images])


def normalised(pixels: torch.Tensor) -> torch.Tensor:
    """[0, 1] RGB images as the model takes them (mean = std = 0.5)."""
    return (pixels - 0.5) / 0.5


def main(out: Path, runs: int = 10, per_concept: int = 24, threads: int = 2, kind: str = "logistic") -> None:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model = load_efficientnet_lite0()
    cat = preprocess(photo("chelsea"))[None]
    with torch.no_grad():
        target = int(model(cat).argmax())
    label = imagenet_categories()[target]
    g = torch.Generator().manual_seed(0)
    concepts = {name: normalised(make(per_concept, g)) for name, make in (("stripes", stripes), ("dots", dots))}
    concepts["grey"] = normalised(grey(per_concept, g))
    others = [name for name in PHOTOS if name != "chelsea"]
    pool = crops(others, per_concept * 6, scale=(0.05, 0.5), seed=1)  # each run draws 3 disjoint sets from it
    inputs = crops(["chelsea"], 16, scale=(0.4, 1.0), seed=2)
    tcav = TCAV(model, LAYERS, concepts, pool, runs=runs, kind=kind, set_size=per_concept, batch_size=16)  # type: ignore[arg-type]
    result = tcav(inputs, target=target)
    took = time.perf_counter() - started
    print(f"target: {label} ({target}); {runs} runs, {per_concept} examples per set; {took:.0f} s")
    for name in concepts:
        row = [result.scores[name][layer] for layer in LAYERS]
        cells = ", ".join(
            f"{layer} {s.sign_count:.2f} (p {s.p_value:.2g})" for layer, s in zip(LAYERS, row, strict=True)
        )
        print(f"{name:8} {cells}")
    plot(out / "concepts_demo.png", result, list(concepts), label)


def plot(path: Path, result: object, names: list[str], label: str) -> None:
    """Sign counts per layer and concept, the random CAVs' mean as a dashed line, significant bars hatched."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(names)
    scores = result.scores  # type: ignore[attr-defined]
    for i, name in enumerate(names):
        for j, layer in enumerate(LAYERS):
            s = scores[name][layer]
            x = j + (i - (len(names) - 1) / 2) * width
            ax.bar(x, s.sign_count, width, color=f"C{i}", hatch="" if s.significant else "//", alpha=0.9,
                   label=name if j == 0 else None, edgecolor="white")  # fmt: skip
            ax.text(x, s.sign_count + 0.02, f"p {s.p_value:.1g}", ha="center", fontsize=6, rotation=90)
            ax.plot([x - width / 2, x + width / 2], [s.random_sign_counts.mean()] * 2, "k--", lw=0.8)
    ax.set_xticks(range(len(LAYERS)), LAYERS)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("TCAV sign count")
    ax.set_title(f"concepts for '{label}' on EfficientNet-Lite0 (hatched: not significant; dashed: random CAVs)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.66, 0.99), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--per-concept", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kind", choices=["logistic", "sgd", "mean"], default="logistic", help="how CAVs are fitted")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    main(args.out, args.runs, args.per_concept, args.threads, args.kind)
