"""Linear datamodeling score against scipy's Spearman and a hand-worked case; the retraining helper."""

from __future__ import annotations

import pytest
import torch

from attribution.influence import linear_datamodeling_score, retrain_on_subsets


def test_lds_equals_scipy_spearman_of_summed_scores_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 8, generator=g, dtype=torch.float64)
    subsets = torch.rand(10, 8, generator=g) > 0.5
    outputs = torch.randn(10, 3, generator=g, dtype=torch.float64).round()  # ties in the outputs
    mean, per = linear_datamodeling_score(scores, subsets, outputs)
    predicted = (scores @ subsets.double().T).numpy()
    expected = [stats.spearmanr(predicted[i], outputs[:, i].numpy()).statistic for i in range(3)]
    torch.testing.assert_close(per, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert mean.item() == pytest.approx(sum(expected) / 3, abs=1e-12)


def test_lds_hand_worked_perfect_and_reversed():
    scores = torch.tensor([[1.0, 2.0, 4.0], [-1.0, 0.0, 0.0]])
    subsets = torch.tensor([[True, False, False], [False, True, False], [False, False, True]])
    outputs = torch.tensor([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]])
    # test 0: summed scores 1, 2, 4 vs 1, 2, 3 -> 1; test 1: -1, 0, 0 (ranks 1, 2.5, 2.5) vs 3, 2, 1 -> -0.866
    mean, per = linear_datamodeling_score(scores, subsets, outputs)
    torch.testing.assert_close(per, torch.tensor([1.0, -(3**0.5) / 2], dtype=torch.float64))
    assert mean.item() == pytest.approx((1 - 3**0.5 / 2) / 2)


def test_lds_bad_shapes_and_masks_are_refused():
    with pytest.raises(ValueError, match="boolean"):
        linear_datamodeling_score(torch.ones(1, 3), torch.ones(2, 3), torch.ones(2, 1))
    with pytest.raises(ValueError, match="shapes disagree"):
        linear_datamodeling_score(torch.ones(1, 3), torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 2))


def test_retrain_on_subsets_is_seeded_and_passes_the_indices():
    seen = []

    def train_fn(indices):
        seen.append(indices)
        return torch.stack([indices.double().sum(), -indices.double().sum()])

    subsets, outputs = retrain_on_subsets(train_fn, 10, n_subsets=4, fraction=0.3, seed=1)
    again, _ = retrain_on_subsets(lambda i: torch.zeros(2), 10, n_subsets=4, fraction=0.3, seed=1)
    assert torch.equal(subsets, again) and subsets.sum(1).tolist() == [3, 3, 3, 3]
    for row, indices in enumerate(seen):
        assert torch.equal(subsets[row].nonzero().flatten(), indices)
        assert outputs[row].tolist() == [indices.sum().item(), -indices.sum().item()]
    with pytest.raises(ValueError, match="fraction"):
        retrain_on_subsets(train_fn, 10, fraction=0.0)


def test_a_test_example_whose_outputs_never_change_is_nan_and_left_out_of_the_mean():
    scores = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])
    subsets = torch.tensor([[True, False, False], [False, True, True], [True, True, False]])
    outputs = torch.tensor([[0.1, 4.0], [0.9, 4.0], [0.5, 4.0]])  # the second example's output is constant
    mean, per_example = linear_datamodeling_score(scores, subsets, outputs)
    assert per_example[0] == pytest.approx(1.0, abs=1e-12) and torch.isnan(per_example[1])
    assert mean == pytest.approx(1.0, abs=1e-12)


def test_lds_equals_dattris_own_toy_example():
    """dattri's test_lds: 2 test and 4 training examples, subsets {0,1}, {0,2}, {1,2} -> [1, sqrt(3)/2]."""
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.2, 0.1, 0.3, 0.4]], dtype=torch.float64)
    outputs = torch.tensor([[0.3, 0.3], [0.4, 0.4], [0.5, 0.3]], dtype=torch.float64)
    subsets = torch.zeros(3, 4, dtype=torch.bool)
    for row, kept in enumerate([[0, 1], [0, 2], [1, 2]]):
        subsets[row, kept] = True
    mean, per_example = linear_datamodeling_score(scores, subsets, outputs)
    torch.testing.assert_close(per_example, torch.tensor([1.0, 3**0.5 / 2], dtype=torch.float64), rtol=0, atol=1e-12)
    assert abs(mean.item() - (1 + 3**0.5 / 2) / 2) < 1e-12
