"""PGD: ours vs captum 0.9's ``PGD`` on a small CNN, one torch thread, CPU time, equal results.

Run from the repository root: python -m benchmarks.robust_speed [--rounds 5] [--steps 10]. A small CNN (conv 3->16,
ReLU, max pool, conv 16->32, ReLU, max pool, linear 2048->10, softmax; random weights, eval), 16 images of
3 x 32 x 32 in [0, 1], L-inf and L2 PGD of ``--steps`` steps (epsilon 8/255, step 2/255 for L-inf; 0.5 and 0.1 for
L2), untargeted on the top classes, bounds [0, 1]. Each variant timed once per round, rounds interleaved; reported:
the median CPU time (``time.process_time``) of each, their ratio (captum / ours), and the largest difference of
the results. Floor: ``--steps`` forwards and backwards of the batch with respect to the inputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from attribution.robust import pgd


def small_cnn() -> nn.Module:
    """The benchmark's CNN, seeded, in eval mode, ending in a softmax (captum's default loss expects probabilities)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2048, 10), nn.Softmax(dim=1),
    ).eval()  # fmt: skip


def cpu_time(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """CPU seconds of one call and its result."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def main() -> None:
    """Times the variants and prints one table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from captum.robust import PGD

    model, x = small_cnn(), torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = model(x).argmax(1)

    def floor() -> torch.Tensor:
        for _ in range(args.steps):
            leaf = x.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(-model(leaf).gather(1, labels[:, None]).log().sum(), leaf)
        return grad

    for norm, eps, step in (("Linf", 8 / 255, 2 / 255), ("L2", 0.5, 0.1)):
        variants = {
            "ours": lambda eps=eps, step=step, norm=norm: pgd(
                model,
                x,
                labels,
                epsilon=eps,
                step_size=step,
                steps=args.steps,
                norm=norm,
                lower_bound=0.0,
                upper_bound=1.0,
            ),
            "captum": lambda eps=eps, step=step, norm=norm: PGD(model, lower_bound=0.0, upper_bound=1.0).perturb(
                x, eps, step, args.steps, labels, norm=norm
            ),
            "floor": floor,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        results: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                seconds, results[name] = cpu_time(fn)
                times[name].append(seconds)
        median = {name: statistics.median(values) for name, values in times.items()}
        diff = (results["ours"] - results["captum"]).abs().max().item()
        print(
            f"{norm:4s} ours {median['ours'] * 1e3:7.1f} ms  captum {median['captum'] * 1e3:7.1f} ms  "
            f"floor {median['floor'] * 1e3:7.1f} ms  captum/ours {median['captum'] / median['ours']:.2f}x  "
            f"ours/floor {median['ours'] / median['floor']:.2f}x  max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
