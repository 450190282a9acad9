"""Parity with Kronfluence 1.0.1: EK-FAC and K-FAC pairwise scores on an MLP and a CNN, float64, empirical Fisher.

Conventions compared (read from Kronfluence's source, ``kronfluence/module/tracker/factor.py`` and ``module/*.py``):

- Sign: both report ``g_test^T P g_train`` (positive: a proponent), no division by the training set size.
- Damping: an explicit ``damping_factor`` is added to every eigenvalue of every module, as our ``damping``.
- EK-FAC: the same eigenbases and the same refit eigenvalues, so the scores are equal to round-off.
- K-FAC on a convolution: Kronfluence divides ``S = sum delta delta^T`` by the number of *positions* (patches), we by
  the number of *examples* (an example's gradient sums its positions, so ours is the Fisher of that gradient under
  K-FAC's independence assumption). Its ``S`` is ours over the module's output positions ``T``, so its K-FAC
  eigenvalues are ours over ``T``; the test maps this explicitly by dividing our eigenvalues of each convolution by its
  ``T`` (a Linear on one position per example has ``T = 1``: no difference).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from attribution.influence import InfluenceFunction

kronfluence = pytest.importorskip("kronfluence")
from kronfluence.analyzer import Analyzer, prepare_model  # noqa: E402
from kronfluence.arguments import FactorArguments, ScoreArguments  # noqa: E402
from kronfluence.task import Task  # noqa: E402

pytestmark = [pytest.mark.peers, pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
DAMPING, RTOL = 1e-3, 1e-9


class Classification(Task):  # type: ignore[misc]
    """Cross-entropy summed over the batch at the true labels (the empirical Fisher's loss and the measurement)."""

    def compute_train_loss(self, batch: list[torch.Tensor], model: nn.Module, sample: bool = False) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    def compute_measurement(self, batch: list[torch.Tensor], model: nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def kronfluence_scores(model: nn.Module, train: tuple, test: tuple, strategy: str, out: Path) -> torch.Tensor:
    """Kronfluence's pairwise scores ``(n_test, n_train)`` on a copy of ``model`` (it wraps the modules), float64."""
    task, f64 = Classification(), torch.float64
    analyzer = Analyzer("parity", prepare_model(copy.deepcopy(model), task), task, cpu=True, disable_tqdm=True,
                        output_dir=str(out))  # fmt: skip
    factor_args = FactorArguments(
        strategy=strategy, use_empirical_fisher=True, activation_covariance_dtype=f64, gradient_covariance_dtype=f64,
        eigendecomposition_dtype=f64, lambda_dtype=f64, per_sample_gradient_dtype=f64,
    )  # fmt: skip
    score_args = ScoreArguments(
        damping_factor=DAMPING, score_dtype=f64, per_sample_gradient_dtype=f64, precondition_dtype=f64
    )
    analyzer.fit_all_factors("f", TensorDataset(*train), per_device_batch_size=16, factor_args=factor_args)
    train_set, test_set = TensorDataset(*train), TensorDataset(*test)
    analyzer.compute_pairwise_scores(
        "s",
        "f",
        test_set,
        train_set,
        per_device_query_batch_size=8,
        per_device_train_batch_size=16,
        score_args=score_args,
    )
    return analyzer.load_pairwise_scores("s")["all_modules"]  # type: ignore[no-any-return]


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(outputs, batch[1], reduction="none")


def mlp() -> tuple[nn.Module, tuple, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    x, y = torch.randn(48, 7, dtype=torch.float64), torch.randint(0, 4, (48,))
    return model, (x, y), (x[:3] + 0.1, y[:3])


def cnn() -> tuple[nn.Module, tuple, tuple]:
    """Non-square inputs, padding, a non-square kernel and stride, groups=1."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, (2, 3), stride=(1, 2)), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 5 * 4, 5),
    ).double()  # fmt: skip
    x, y = torch.randn(40, 2, 6, 9, dtype=torch.float64), torch.randint(0, 5, (40,))
    return model, (x, y), (torch.randn(5, 2, 6, 9, dtype=torch.float64), y[:5])


@pytest.mark.parametrize(
    ("build", "strategy"), [(mlp, "ekfac"), (cnn, "ekfac"), (cnn, "kfac")], ids=["mlp-ekfac", "cnn-ekfac", "cnn-kfac"]
)  # K-FAC on the MLP adds nothing the CNN's K-FAC (its convention mapped) and the MLP's EK-FAC do not check
def test_pairwise_scores_equal_kronfluences(build, strategy, tmp_path):
    model, train, test = build()
    expected = kronfluence_scores(model, train, test, strategy, tmp_path)
    ours = InfluenceFunction(model, loss, method=strategy, damping=DAMPING, fisher="empirical").fit(train)
    if strategy == "kfac":  # Kronfluence's S of a convolution is a mean over positions: its eigenvalues are ours / T
        for name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                ours.state[f"lambda/{name}"] = ours.state[f"lambda/{name}"] / output_positions(model, module, train[0])
    scores = ours.scores(test, train)
    assert expected.shape == scores.shape == (test[1].shape[0], train[1].shape[0])
    assert (expected > 0).any() and (expected < 0).any()
    torch.testing.assert_close(scores, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def output_positions(model: nn.Module, module: nn.Module, x: torch.Tensor) -> int:
    """The number of output positions of ``module`` per example (height x width of its output)."""
    seen: list[int] = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o[0, 0].numel()))
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        handle.remove()
    return seen[0]
