"""EK-FAC influence: factor fitting and pairwise scores, hookscope's InfluenceFunction against Kronfluence 1.0.1.

Run from the repository root (Kronfluence installed, e.g. the peers' virtual environment of ``.ci/peers``):
python -m benchmarks.influence_ekfac_speed [--rounds 1] [--memory]

Same model, same data, same settings on both sides: float32 (Kronfluence's defaults: covariances and Lambda in
float32, eigendecompositions in float64; ours keeps float32 throughout, eigendecompositions included),
the empirical Fisher (the true labels: a sampled Fisher draws different labels on each side), explicit damping
1e-3 per eigenvalue, batches of 100 for the fit, the test and the training set. Scores are checked equal first
(max relative difference over the score matrix, against its largest magnitude).

* CNN: 32x32 RGB inputs, Conv(3->16, 3x3) - ReLU - MaxPool - Conv(16->32, 3x3) - ReLU - MaxPool - Linear(2048->64)
  - ReLU - Linear(64->10); 2,000 training and 100 test examples, scores (100, 2000).
* MLP: 64-256-256-10 with Tanh; the same counts.

Times are the CPU time of the process on one torch thread (``time.process_time``), the minimum over interleaved
rounds (the run that checks the scores is the warm-up); Kronfluence's include its writing of factors and scores to a
temporary folder (it always does). "fit" is both passes (covariances with eigendecompositions, then the eigenvalue
correction); "scores" is the pairwise scores from fitted factors. Peak memory (``--memory``) is the largest total of
the tensor storages the call creates (``benchmarks._timing.memory``; model and data not counted).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from attribution.influence import InfluenceFunction
from benchmarks._timing import interleaved, memory, setup, table

N_TRAIN, N_TEST, BATCH, DAMPING = 2000, 100, 100, 1e-3


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def data(shape: tuple[int, ...]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    x, y = torch.randn(N_TRAIN + N_TEST, *shape), torch.randint(0, 10, (N_TRAIN + N_TEST,))
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def loss(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(outputs, batch[1], reduction="none")


class Ours:
    """hookscope's EK-FAC: fit, then scores."""

    def __init__(self, model: nn.Module, train: tuple, test: tuple) -> None:
        self.model, self.train, self.test = model, DataLoader(TensorDataset(*train), batch_size=BATCH), test
        self.fitted: InfluenceFunction | None = None

    def fit(self) -> InfluenceFunction:
        self.fitted = InfluenceFunction(self.model, loss, damping=DAMPING, fisher="empirical").fit(self.train)
        return self.fitted

    def scores(self) -> torch.Tensor:
        assert self.fitted is not None
        return self.fitted.scores(self.test, self.train)


class Theirs:
    """Kronfluence 1.0.1's EK-FAC (its Analyzer on a wrapped copy of the model, outputs in a temporary folder)."""

    def __init__(self, model: nn.Module, train: tuple, test: tuple) -> None:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task

        class Classification(Task):  # type: ignore[misc]
            def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> torch.Tensor:
                return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

            def compute_measurement(self, batch: Any, model: nn.Module) -> torch.Tensor:
                return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

        task, self.folder = Classification(), tempfile.mkdtemp()
        wrapped = prepare_model(copy.deepcopy(model), task)
        self.analyzer = Analyzer("bench", wrapped, task, cpu=True, disable_tqdm=True, output_dir=self.folder)
        self.factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
        self.score_args = ScoreArguments(damping_factor=DAMPING)
        self.train, self.test = TensorDataset(*train), TensorDataset(*test)

    def fit(self) -> None:
        self.analyzer.fit_all_factors(
            "f", self.train, per_device_batch_size=BATCH, factor_args=self.factor_args, overwrite_output_dir=True
        )

    def scores(self) -> torch.Tensor:
        self.analyzer.compute_pairwise_scores(
            "s", "f", self.test, self.train, per_device_query_batch_size=BATCH, per_device_train_batch_size=BATCH,
            score_args=self.score_args, overwrite_output_dir=True,
        )  # fmt: skip
        return self.analyzer.load_pairwise_scores("s")["all_modules"]  # type: ignore[no-any-return]


def rows(name: str, model: nn.Module, shape: tuple[int, ...], rounds: int, with_memory: bool) -> list[list[str]]:
    train, test = data(shape)
    ours, theirs = Ours(model, train, test), Theirs(model, train, test)
    ours.fit(), theirs.fit()
    expected = theirs.scores()
    difference = float((ours.scores() - expected).abs().max() / expected.abs().max())
    out = []
    for step in ("fit", "scores"):
        variants = {"hookscope": getattr(ours, step), "Kronfluence": getattr(theirs, step)}
        times = interleaved(variants, rounds, warmup=0, statistic=min, clock=time.process_time)  # warmed by the check
        peaks = {k: f"{memory(fn)[0]:.0f} MiB" if with_memory else "-" for k, fn in variants.items()}
        ratio = times["hookscope"] / times["Kronfluence"]
        out += [[f"{name} {step}", f"{times['hookscope']:.2f} s", f"{times['Kronfluence']:.2f} s", f"{ratio:.2f}x",
                 peaks["hookscope"], peaks["Kronfluence"], f"{difference:.1e}"]]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (slow: every op is traced)")
    args = parser.parse_args()
    setup(threads=1)
    found = rows("CNN 32x32", cnn(), (3, 32, 32), args.rounds, args.memory)
    found += rows("MLP", mlp(), (64,), args.rounds, args.memory)
    header = [
        "EK-FAC, 2000 train x 100 test",
        "hookscope",
        "Kronfluence",
        "ratio",
        "peak ours",
        "peak theirs",
        "max rel",
    ]
    print(table(header, found))


if __name__ == "__main__":
    main()
