"""Activation patching on a small transformer trained in seconds to recall a token.

Task: in a sequence of random tokens, predict at the last position the token that was at position 1. We corrupt
position 1 and ask, layer by layer and position by position, where the clean residual stream restores the answer:
at the first block's input the information sits at position 1; by the last block's input attention has moved it to
the last position. Then per head: which head does the moving.

Run: python examples/patching_demo.py [--out out/]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from attribution import activation_patching
from attribution.plot import plot_patching

VOCAB, LENGTH, WIDTH, HEADS = 12, 6, 48, 4


class CausalSelfAttention(nn.Module):
    """Heads computed with one fused projection; ``proj`` receives the heads side by side, so its input is the
    per-head site ("b t (h d)")."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, WIDTH // HEADS)).permute(2, 0, 3, 1, 4)
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, tokens, head_dim)
        return self.proj(heads.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Recaller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Parameter(0.1 * torch.randn(LENGTH, WIDTH))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.unembed = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


def batch(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH), generator=generator)


def train(model: nn.Module, generator: torch.Generator, steps: int = 150) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        tokens = batch(128, generator)
        loss = F.cross_entropy(model(tokens)[:, -1], tokens[:, 1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        tokens = batch(1000, generator)
        return float((model(tokens)[:, -1].argmax(-1) == tokens[:, 1]).float().mean())


def main(out: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a second thread gains little here, and costs many-fold on busy cores
    generator = torch.Generator().manual_seed(0)
    model = Recaller()
    accuracy = train(model, generator)
    print(f"trained to recall the token at position 1: accuracy {accuracy:.1%}")

    clean = batch(16, generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 1 + torch.randint(0, VOCAB - 1, (16,), generator=generator)) % VOCAB
    rows = torch.arange(16)

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1]
        return (last[rows, clean[:, 1]] - last[rows, corrupted[:, 1]]).mean()

    layers = ["blocks.0", "blocks.1", "unembed"]
    resid = activation_patching(
        model, clean, corrupted, layers, logit_diff, site="input", normalize=True, progress=False
    )
    heads = activation_patching(
        model,
        clean,
        corrupted,
        "blocks.*.attn.proj",
        logit_diff,
        site="input",
        heads=HEADS,
        positions=False,
        normalize=True,
        progress=False,
    )
    print("\nrestored share of the clean logit difference (0 = corrupted, 1 = clean), residual stream:")
    print("            " + "  ".join(f"pos {p}" for p in range(LENGTH)))
    for name, row in zip(["blocks.0 in", "blocks.1 in", "final in"], resid, strict=True):
        print(f"{name:11s} " + "  ".join(f"{v:5.2f}" for v in row.tolist()))
    print("\nper head (all positions):")
    for layer, row in enumerate(heads):
        print(f"  block {layer}: " + "  ".join(f"H{h} {v:5.2f}" for h, v in enumerate(row.tolist())))

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3), gridspec_kw={"width_ratios": [LENGTH, HEADS]})
    labels = ["t0", "t1 (key)", *[f"t{p}" for p in range(2, LENGTH - 1)], "last"]
    plot_patching(
        resid,
        tokens=labels,
        layers=["blocks.0 in", "blocks.1 in", "final in"],
        ax=axes[0],
        title="residual stream: layer x position",
        annotate=True,
    )
    plot_patching(
        heads,
        layers=["block 0", "block 1"],
        tokens=[f"H{h}" for h in range(HEADS)],
        ax=axes[1],
        title="attention heads (all positions)",
        annotate=True,
    )
    fig.tight_layout()
    path = out / "patching_recall.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
