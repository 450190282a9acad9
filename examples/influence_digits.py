"""Which training images made this prediction? Influence on scikit-learn's bundled digits, with 10% of labels flipped.

A small CNN is trained for a few seconds on 1,200 of the 1,797 8x8 digits that ship with scikit-learn (no
download), after the labels of 10% of its training images were changed to another class at random. Then:

1. Self-influence (each training image's influence on its own loss) ranks the images whose labels were flipped
   first: a mislabelled image is one the model had to bend to fit. Reported: the AUC of finding the flipped images by
   TracIn's (over the saved checkpoints) and by EK-FAC's self-influence, and the fraction of them among the top 10%.
2. For the test images the model gets wrong, the training images that pushed it there (top proponents) and those
   that held it back (top opponents) under EK-FAC, as a picture.
3. The linear datamodeling score (LDS): ``--subsets`` models retrained on random halves of the training set; how
   well the summed scores of each half predict the retrained model's test losses, for identity (gradient
   similarity), TracIn, K-FAC and EK-FAC.

Run: ``python3 examples/influence_digits.py`` (needs scikit-learn for the data); writes ``out/influence_digits.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import nn

from attribution.influence import InfluenceFunction, TracIn, linear_datamodeling_score, retrain_on_subsets

LOSS = nn.CrossEntropyLoss(reduction="none")


def digits(seed: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(train images, train labels (10% flipped), test images, test labels)`` and the flipped training rows."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16
    y = torch.tensor(data.target)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    train, test = order[:1200], order[1200:]
    labels = y[train].clone()
    flipped = torch.randperm(len(train), generator=g)[: len(train) // 10]
    labels[flipped] = (labels[flipped] + torch.randint(1, 10, (len(flipped),), generator=g)) % 10
    return (x[train], labels, x[test], y[test]), flipped


def network(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )  # fmt: skip


def train(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int = 0) -> tuple[nn.Module, list[tuple[Any, float]]]:
    """SGD with momentum in batches of 64; a checkpoint (state dict, learning rate) after every epoch."""
    model, lr = network(seed), 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    checkpoints = []
    for _ in range(epochs):
        for rows in torch.randperm(len(x), generator=g).split(64):
            optimizer.zero_grad()
            LOSS(model(x[rows]), y[rows]).mean().backward()
            optimizer.step()
        checkpoints.append(({k: v.clone() for k, v in model.state_dict().items()}, lr))
    return model.eval(), checkpoints


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The probability that a positive example scores above a negative one (ties count half)."""
    pos, neg = scores[positive], scores[~positive]
    return float(((pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()).mean())


def show(ax: Any, image: torch.Tensor, title: str, color: str = "black") -> None:
    ax.imshow(image[0], cmap="gray_r")
    ax.set_title(title, fontsize=8, color=color)
    ax.set_xticks([])
    ax.set_yticks([])


def caption(label: torch.Tensor, score: torch.Tensor, flipped: torch.Tensor) -> str:
    return f"label {label.item()}{', flipped' if flipped else ''}\n{score:+.2g}"


def plot(out: Path, data: tuple[torch.Tensor, ...], model: nn.Module, scores: Any, rows: Any, flipped: Any) -> None:
    """One row per misclassified test image: it, its 3 top proponents (blue) and 3 top opponents (red); a training
    image whose label was flipped says so."""
    x, y, xt, yt = data
    fig, axes = plt.subplots(len(rows), 7, figsize=(10, 1.8 * len(rows) + 0.5), squeeze=False)
    predicted = model(xt[rows]).argmax(1)
    for r, (i, p) in enumerate(zip(rows.tolist(), predicted.tolist(), strict=True)):
        show(axes[r, 0], xt[i], f"test: a {yt[i].item()}\nthe model says {p}")
        for c, j in enumerate(scores[r].topk(3).indices.tolist()):
            show(axes[r, 1 + c], x[j], caption(y[j], scores[r, j], flipped[j]), "tab:blue")
        for c, j in enumerate(scores[r].topk(3, largest=False).indices.tolist()):
            show(axes[r, 4 + c], x[j], caption(y[j], scores[r, j], flipped[j]), "tab:red")
    fig.suptitle("misclassified test digits; EK-FAC's top proponents (blue) and opponents (red) among training images")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(out: Path, epochs: int = 12, subsets: int = 50, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    data, flipped = digits()
    x, y, xt, yt = data
    model, checkpoints = train(x, y, epochs)
    accuracy = (model(xt).argmax(1) == yt).double().mean().item()
    took = time.perf_counter() - started
    print(f"trained in {took:.1f} s; test accuracy {accuracy:.3f} ({len(flipped)} training labels flipped)")

    is_flipped = torch.zeros(len(x), dtype=torch.bool)
    is_flipped[flipped] = True
    methods: dict[str, Any] = {
        "TracIn": TracIn(model, checkpoints, LOSS),
        "identity": InfluenceFunction(model, LOSS, method="identity"),
        "K-FAC": InfluenceFunction(model, LOSS, method="kfac").fit((x, y)),
        "EK-FAC": InfluenceFunction(model, LOSS, method="ekfac").fit((x, y)),
    }
    for name in ("TracIn", "EK-FAC"):
        own = methods[name].self_influence((x, y))
        top = own.topk(len(x) // 10).indices
        print(f"{name} self-influence: AUC {auc(own, is_flipped):.3f} of finding the flipped labels; "
              f"{is_flipped[top].double().mean():.0%} of its top 10% are flipped")  # fmt: skip

    wrong = torch.nonzero(model(xt).argmax(1) != yt)[:4, 0]
    scores = methods["EK-FAC"].scores((xt[wrong], yt[wrong]), (x, y))
    plot(out / "influence_digits.png", data, model, scores, wrong, is_flipped)

    def retrained(indices: torch.Tensor) -> torch.Tensor:
        again, _ = train(x[indices], y[indices], epochs, seed=1)
        with torch.no_grad():
            return -LOSS(again(xt[:100]), yt[:100])  # a proponent lowers the test loss: correlate with -loss

    masks, outputs = retrain_on_subsets(retrained, len(x), n_subsets=subsets, seed=0)
    for name, method in methods.items():
        mean, _ = linear_datamodeling_score(method.scores((xt[:100], yt[:100]), (x, y)), masks, outputs)
        print(f"LDS {name}: {mean:.3f} ({subsets} subsets of half the training set, 100 test images)")
    print(f"done in {time.perf_counter() - started:.0f} s; wrote {out / 'influence_digits.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    main(args.out, args.epochs, args.subsets, args.threads)
