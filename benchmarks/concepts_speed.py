"""TCAV time against captum 0.9's TCAV on a small CNN: CPU time of the process on one torch thread.

Run from the repository root: python -m benchmarks.concepts_speed [--rounds 3] [--runs 10]

The model: two 3x3 convolutions (3 -> 8 -> 16 channels, ReLU) on 32x32 images, average pooling and a linear head of
10 classes, random weights. Two concepts of 20 images each, ``runs + 1`` random sets of 20 images (Kim et al.'s
design: concept vs random set ``i + 1``, and random set 0 vs random set ``i + 1`` for the random-vs-random CAVs),
layers ``conv1`` and ``conv2`` (8192 and 16384 values per image), 32 inputs explained for class 3. captum runs the same
experimental sets (``[concept, random i+1]`` and ``[random 0, random i+1]``) with its default classifier
(scikit-learn's ``SGDClassifier``) and its default layer gradients, in a fresh ``save_path`` each time (it caches
activations and CAVs on disk); hookscope with ``kind="sgd"`` (the same kind of classifier) and ``"logistic"``
(its default: L-BFGS) and ``"mean"``. Each call computes everything from the examples: activations, CAVs, gradients,
scores (hookscope also its t-tests). Times are the minimum over the rounds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from typing import Any

import torch

from attribution.concepts import TCAV
from benchmarks._timing import interleaved, setup

SIZE, EXAMPLES, INPUTS, TARGET = 32, 20, 32, 3


class SmallCNN(torch.nn.Module):
    """Two convolutions, average pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = torch.nn.ReLU()
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.relu2 = torch.nn.ReLU()
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, 10)``."""
        return self.fc(self.pool(self.relu2(self.conv2(self.relu1(self.conv1(x))))).flatten(1))


def data(runs: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Concepts (a striped and a bright set), ``runs + 1`` random sets, the inputs."""
    stripes = torch.zeros(1, 3, SIZE, SIZE)
    stripes[..., ::4, :] = 2.0
    concepts = {
        "stripes": torch.randn(EXAMPLES, 3, SIZE, SIZE) + stripes,
        "bright": torch.randn(EXAMPLES, 3, SIZE, SIZE) + 1.5,
    }
    randoms = [torch.randn(EXAMPLES, 3, SIZE, SIZE) for _ in range(runs + 1)]
    return concepts, randoms, torch.randn(INPUTS, 3, SIZE, SIZE)


def ours(model: torch.nn.Module, concepts: Any, randoms: Any, inputs: torch.Tensor, runs: int, kind: str) -> Any:
    """hookscope's TCAV from scratch."""
    return TCAV(model, ["conv1", "conv2"], concepts, randoms, runs=runs, kind=kind)(inputs, target=TARGET)  # type: ignore[arg-type]


def captums(model: torch.nn.Module, concepts: Any, randoms: Any, inputs: torch.Tensor, runs: int) -> Any:
    """captum's TCAV from scratch (a fresh cache directory), the same experimental sets."""
    from captum.concept import TCAV as CaptumTCAV
    from captum.concept import Concept
    from torch.utils.data import DataLoader

    def concept(i: int, name: str, x: torch.Tensor) -> Concept:
        return Concept(i, name, DataLoader(x, batch_size=64))  # type: ignore[arg-type]

    own = [concept(i, name, x) for i, (name, x) in enumerate(concepts.items())]
    rand = [concept(100 + i, f"random{i}", x) for i, x in enumerate(randoms)]
    sets = [[c, rand[i + 1]] for c in own for i in range(runs)] + [[rand[0], rand[i + 1]] for i in range(runs)]
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tcav = CaptumTCAV(model, ["conv1", "conv2"], save_path=path + "/")
        return tcav.interpret(inputs, sets, target=TARGET)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    setup(threads=1)
    model = SmallCNN().eval()
    concepts, randoms, inputs = data(args.runs)
    variants = {
        f"hookscope kind={kind}": lambda kind=kind: ours(model, concepts, randoms, inputs, args.runs, kind)
        for kind in ("sgd", "logistic", "mean")
    }
    variants["captum 0.9 (SGDClassifier)"] = lambda: captums(model, concepts, randoms, inputs, args.runs)
    times = interleaved(variants, args.rounds, warmup=1, statistic=min, clock=time.process_time)
    peer = times["captum 0.9 (SGDClassifier)"]
    print(f"TCAV, 2 concepts x 2 layers x {args.runs} runs (+ {args.runs} random CAVs per layer), {INPUTS} inputs")
    print("| variant | CPU s (1 thread) | captum / this |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} | {peer / seconds:.2f}x |")


if __name__ == "__main__":
    main()
