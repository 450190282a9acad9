"""A tour of `hooks` on a ResNet-18 (random weights, CPU, a few seconds).

1. trace the module calls of one forward, in order, repeated calls included;
2. record activations of every block with a running mean over several batches;
3. edit an output (switch off half of layer3's channels) and undo it by deactivating the group;
4. backward hooks through ResNet's in-place ReLUs, where `register_full_backward_hook` fails;
5. an input-gradient saliency map of one image, from a recorded gradient, saved as a PNG.

Run: python examples/hooks_tour.py [--out out/]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torchvision

from hooks import HookManager, Recorder, trace


def main(out: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a second thread gains little here, and costs many-fold on busy cores
    model = torchvision.models.resnet18(weights=None).eval()
    images = torch.randn(4, 3, 128, 128)

    print("1. the first calls of a forward (start order; ReLUs run twice per block):")
    calls = trace(model, images[:1])
    print("\n".join(str(calls).splitlines()[:12]))
    print(f"   ... {len(calls)} module calls in all\n")

    print("2. mean activation of each block over 3 batches:")
    with Recorder(model, "layer*.?", reduction="mean") as rec:
        for _ in range(3):
            model(torch.randn(4, 3, 128, 128))
    for name in rec.names:
        act = rec[name].output
        print(f"   {name:9s} {tuple(act.shape)!s:18s} mean {act.mean():.4f}  samples {rec[name].samples}")

    print("\n3. editing an output, then deactivating the edit:")
    mgr = HookManager(model)
    edit = mgr.group("ablate-half-of-layer3")

    def ablate(module, args, output):
        output = output.clone()
        output[:, : output.shape[1] // 2] = 0
        return output

    edit.forward("layer3", ablate)
    ablated = model(images).softmax(-1)
    edit.deactivate()
    plain = model(images).softmax(-1)
    print(f"   largest change in a class probability: {(ablated - plain).abs().max():.4f}")
    edit.remove()

    print("\n4. backward hooks on modules followed by in-place ReLUs (one record per call):")
    grads = {}
    with mgr.group("grads") as g:
        g.backward(
            ["layer1.0.bn2", "layer1.0.relu"],
            lambda m, gi, go, *, name, call: grads.__setitem__((name, call), go[0].norm().item()),
        )
        model(images).logsumexp(-1).sum().backward()
    for (name, call), norm in sorted(grads.items()):
        print(f"   {name} call {call}: |grad_output| = {norm:.3e}")
    try:
        handle = model.layer1[0].bn2.register_full_backward_hook(lambda *a: None)
        model(images).sum().backward()
    except RuntimeError as exc:
        print(f"   (register_full_backward_hook on the same module fails: {str(exc).split('.')[0]}.)")
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)

    print("\n5. input-gradient saliency of one image, recorded at the first convolution:")
    image = images[:1].clone().requires_grad_(True)
    with Recorder(model, "conv1", capture="grad_input") as rec:
        logits = model(image)
        logits[0, logits.argmax()].backward()
    saliency = rec["conv1"].grad_input[0].abs().amax(0)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hooks_tour_saliency.png"
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.5))
    shown = image[0].detach().permute(1, 2, 0)
    axes[0].imshow((shown - shown.min()) / (shown.max() - shown.min()))
    axes[0].set_title("input (noise)")
    im = axes[1].imshow(saliency, cmap="inferno")
    axes[1].set_title("|d top logit / d input|")
    fig.colorbar(im, ax=axes[1], fraction=0.046)
    for ax in axes:
        ax.axis("off")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"   wrote {path}")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "a hook was left behind"
    print("\nno hook left on the model.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out"))
    main(parser.parse_args().out)
