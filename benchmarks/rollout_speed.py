"""Attention rollout cost on timm vit_tiny_patch16_224 and torchvision vit_b_16, batch 8, 224x224, 2 threads.

Run from the repository root: python -m benchmarks.rollout_speed [--rounds 5]
Floor: a plain no_grad forward with the attention path the rollout needs (timm: fused attention off; torchvision:
nn.MultiheadAttention asked for its weights). Also shown: the default (fused) forward, jacobgil's vit-explain-style
hooking (forward hooks appending every map to a list, then its rollout loop), and the gradient rollout against a
plain forward + backward.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from attribution import AttentionRollout, GradientRollout
from benchmarks._timing import interleaved, memory, setup, table


@contextmanager
def weights_path(model: torch.nn.Module, family: str) -> Iterator[list[torch.Tensor]]:
    """Raw PyTorch hooks that switch on the attention-weights path and collect the maps (vit-explain style)."""
    maps: list[torch.Tensor] = []
    handles = []
    if family == "timm":
        for block in model.blocks:
            block.attn.fused_attn = False
            handles.append(block.attn.attn_drop.register_forward_hook(lambda m, i, o: maps.append(o.cpu())))
    else:
        for layer in model.encoder.layers:
            handles.append(
                layer.self_attention.register_forward_pre_hook(
                    lambda m, a, k: (a, {**k, "need_weights": True, "average_attn_weights": False}), with_kwargs=True
                )
            )
            handles.append(layer.self_attention.register_forward_hook(lambda m, i, o: maps.append(o[1].cpu())))
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()
        if family == "timm":
            for block in model.blocks:
                block.attn.fused_attn = True


def vit_explain_rollout(attentions: list[torch.Tensor], discard_ratio: float = 0.9) -> torch.Tensor:
    """The loop of jacobgil/vit-explain's rollout (mean fusion), quirks included, written out for timing."""
    result = torch.eye(attentions[0].size(-1))
    with torch.no_grad():
        for attention in attentions:
            fused = attention.mean(dim=1)
            flat = fused.view(fused.size(0), -1)
            _, indices = flat.topk(int(flat.size(-1) * discard_ratio), -1, False)
            indices = indices[indices != 0]
            flat[0, indices] = 0
            a = (fused + torch.eye(fused.size(-1))) / 2
            a = a / a.sum(dim=-1).unsqueeze(1)  # its division by the wrong axis, kept for batches
            result = torch.matmul(a, result)
    mask = result[:, 0, 1:]
    return mask / mask.max()


def models() -> dict[str, tuple[torch.nn.Module, str]]:
    found: dict[str, tuple[torch.nn.Module, str]] = {}
    try:
        import timm

        found["timm vit_tiny_patch16_224"] = (
            timm.create_model("vit_tiny_patch16_224", pretrained=False).eval(),
            "timm",
        )
    except ImportError:
        print("timm is not installed: its model is left out")
    import torchvision

    found["torchvision vit_b_16"] = (torchvision.models.vit_b_16(weights=None).eval(), "torchvision")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    setup(2)
    for title, (model, family) in models().items():
        bench(title, model, family, args.batch, args.rounds)


def bench(title: str, model: torch.nn.Module, family: str, batch: int, rounds: int) -> None:
    x = torch.randn(batch, 3, 224, 224)
    rollout, discarding = AttentionRollout(model), AttentionRollout(model, discard_ratio=0.9)
    gradient = GradientRollout(model)

    def floor() -> Any:
        with weights_path(model, family), torch.no_grad():
            return model(x)

    def fused() -> Any:
        with torch.no_grad():
            return model(x)

    def explain() -> Any:
        with weights_path(model, family) as maps, torch.no_grad():
            model(x)
        return vit_explain_rollout(maps)

    def forward_backward() -> Any:
        with weights_path(model, family):
            out = model(x)
            return torch.autograd.grad(out[:, 0].sum(), [p for p in model.parameters() if p.requires_grad][:1])

    variants: dict[str, Callable[[], Any]] = {
        "forward, weights path (floor)": floor,
        "forward, default fused path": fused,
        "hookscope AttentionRollout": lambda: rollout(x),
        "hookscope AttentionRollout, discard 0.9": lambda: discarding(x),
        "vit-explain-style hooks + rollout, discard 0.9": explain,
        "forward + backward, weights path": forward_backward,
        "hookscope GradientRollout": lambda: gradient(x, 0),
    }
    times = interleaved(variants, repeats=rounds)
    peaks = {name: memory(fn)[0] for name, fn in variants.items()}
    t0, tb = times["forward, weights path (floor)"], times["forward + backward, weights path"]
    rows = [[name, f"{t:.3f}", f"{t / t0:.2f}", f"{t / tb:.2f}", f"{peaks[name]:.0f}"] for name, t in times.items()]
    print(f"{title}, batch {batch}, 224x224, 2 threads; median of {rounds}")
    print(table(["variant", "s", "x floor", "x fwd+bwd", "peak MiB"], rows))
    print()


if __name__ == "__main__":
    main()
