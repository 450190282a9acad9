"""Layer conductance: CPU time of ours vs captum's ``LayerConductance`` on a small CNN, one torch thread.

Run from the repository root: python -m benchmarks.conductance_speed [--rounds 5] [--batch 4]
Model: a 3-conv CNN on 3x32x40 images (random weights, eval, float32), the layer its second ReLU; 50 Gauss-Legendre
steps (51 nodes), all nodes in one forward on both sides, target class 3; CPU time (``time.process_time``), median
of ``rounds`` interleaved runs. The results are checked equal (1e-4 relative) before timing.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from attribution import LayerConductance
from benchmarks._timing import interleaved, setup


def cnn() -> nn.Sequential:
    """A small CNN: three 3x3 convolutions with ReLUs, global average pooling, 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    setup(threads=1)
    import captum.attr

    model = cnn()
    x = torch.randn(args.batch, 3, 32, 40)
    ours = LayerConductance(model, "3", steps=50)
    theirs = captum.attr.LayerConductance(model, model[3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = ours(x, target=3), theirs.attribute(x, target=3, n_steps=50)
    torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-4 * float(b.detach().abs().max()))
    times = interleaved(
        {"ours": lambda: ours(x, target=3), "captum": lambda: theirs.attribute(x, target=3, n_steps=50)},
        repeats=args.rounds,
        clock=time.process_time,
    )
    print(f"LayerConductance, batch {args.batch}, 50 steps, CPU s (1 thread)")
    print(f"ours   {times['ours']:.4f}\ncaptum {times['captum']:.4f}\nratio  {times['captum'] / times['ours']:.2f}x")


if __name__ == "__main__":
    main()
