"""AttnLRP on a small vision transformer trained in seconds, beside Grad-CAM and attention rollout.

A timm VisionTransformer (32x32 images, 8-pixel patches: a 4x4 grid, 2 blocks) learns whether the bright square
on one of the 16 patches is filled or hollow: the label needs the object, not where it is. On held-out images the
script counts how often each method's peak lies on the object's patch and how much of the map's positive mass the
patch holds (of 16 patches: 6.25% for a flat map), and draws four of them.

Run: python examples/attnlrp_vit.py [--out out/]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import timm
import torch
import torch.nn.functional as F

from attribution import AttentionRollout, AttnLRP, GradCAM
from attribution.plot import overlay


def squares(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise with a bright 6x6 square on one of the 16 patches, hollow for class 1; images, labels, the patch."""
    labels = torch.randint(0, 2, (n,), generator=generator)
    cells = torch.randint(0, 16, (n,), generator=generator)
    images = torch.randn(n, 3, 32, 32, generator=generator) * 0.3
    for i in range(n):
        top, left = 8 * (int(cells[i]) // 4), 8 * (int(cells[i]) % 4)
        images[i, :, top + 1 : top + 7, left + 1 : left + 7] += 2.0
        if labels[i] == 1:
            images[i, :, top + 3 : top + 5, left + 3 : left + 5] -= 2.0
    return images, labels, cells


def train() -> torch.nn.Module:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        num_classes=2,
    )  # fmt: skip
    optimiser = torch.optim.Adam(vit.parameters(), lr=2e-3)
    for _ in range(200):
        images, labels, _ = squares(64, generator)
        loss = F.cross_entropy(vit(images), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return vit.eval()


def patch_maps(vit: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """``(n, 4, 4)`` per method: each map averaged over its 8x8 patches where it is finer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Grad-CAM's map is all zero, with a warning, for a few items
        maps = {
            "AttnLRP": AttnLRP(vit)(images, target=labels),
            "Grad-CAM": GradCAM(vit, "blocks.1.norm1")(images, labels),
            "rollout": AttentionRollout(vit)(images, upsample=True),
        }
    return {name: F.adaptive_avg_pool2d(m[:, None], 4)[:, 0] if m.shape[-1] != 4 else m for name, m in maps.items()}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vit = train()
    trained = time.perf_counter()
    images, labels, cells = squares(500, torch.Generator().manual_seed(1))
    with torch.no_grad():
        accuracy = (vit(images).argmax(1) == labels).float().mean().item()
    print(f"trained in {trained - start:.1f} s; held-out accuracy {accuracy:.1%} on {len(images)} images")
    maps = patch_maps(vit, images, labels)
    for name, m in maps.items():
        flat = m.flatten(1)
        hits = (flat.argmax(1) == cells).float().mean().item()
        positive = flat.clamp(min=0)
        on_object = positive.gather(1, cells[:, None])[:, 0]
        share = (on_object / positive.sum(1).clamp(min=1e-30)).median().item()  # an all-zero map: a share of 0
        print(f"{name:9s} peak on the object's patch in {hits:.1%} of the images; median share of the map's ", end="")
        print(f"positive mass on it {share:.1%}")
    result = AttnLRP(vit).attribute_image(images, target=labels)
    ratio = result.conservation
    print(f"AttnLRP conservation (tokens' relevance / logit): median {ratio.median():.3f}, ", end="")
    print(f"quartiles {ratio.quantile(0.25):.3f} .. {ratio.quantile(0.75):.3f}")
    draw(out, images[:4], labels[:4], {name: m[:4] for name, m in maps.items()})
    print(f"total {time.perf_counter() - start:.1f} s")


def draw(out: Path, images: torch.Tensor, labels: torch.Tensor, maps: dict[str, torch.Tensor]) -> None:
    fig, axes = plt.subplots(1 + len(maps), 4, figsize=(8, 2.1 * (1 + len(maps))))
    for i in range(4):
        axes[0, i].imshow(images[i].permute(1, 2, 0).clamp(-1, 2.5).add(1).div(3.5).numpy())
        axes[0, i].set_title("hollow" if labels[i] else "filled")
        axes[0, i].set_axis_off()
        for row, (name, m) in enumerate(maps.items(), start=1):
            big = F.interpolate(m[i][None, None], size=32, mode="nearest")[0, 0]
            overlay(images[i], big, ax=axes[row, i], alpha=0.6, vmin=None, title=name if i == 0 else None)
    fig.tight_layout()
    path = out / "attnlrp_vit_squares.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
