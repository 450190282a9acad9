"""TCAV: planted directions give the known sign counts, p-values are scipy's t-test, scores come labelled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.concepts import TCAV, ConceptScore, TCAVResult, cav
from attribution.concepts._draws import pool_runs

from .models import nonlinear_head, randn, seeded, small_cnn

PLANTED = torch.tensor([0.4, -1.0, 0.0, 0.7, 1.5], dtype=torch.float64)


def linear_head() -> nn.Module:
    """Identity ("0") then Linear(5 -> 3) whose class 1 row is the planted direction: its gradient everywhere."""
    model = seeded(nn.Sequential(nn.Identity(), nn.Linear(5, 3)), 0)
    with torch.no_grad():
        model[1].weight[1] = PLANTED
    return model


def planted(model: nn.Module, target: int, inputs: torch.Tensor) -> torch.Tensor:
    """The unit mean gradient of the target logit over ``inputs``: the direction the concept is planted along."""
    x = inputs.clone().requires_grad_(True)
    model(x)[:, target].sum().backward()
    model.zero_grad(set_to_none=True)
    return x.grad.mean(0) / x.grad.mean(0).norm()


@pytest.mark.parametrize(("pool", "kind"), [(True, "sgd"), (False, "logistic")])
def test_a_linear_head_gives_sign_count_one_for_the_planted_concept_and_zero_for_its_negation(pool, kind):
    concepts = {"up": randn(12, 5, seed=1) + 2 * PLANTED, "down": randn(12, 5, seed=2) - 2 * PLANTED}
    randoms = randn(80, 5, seed=3) if pool else list(randn(66, 5, seed=3).split(11))
    result = TCAV(linear_head(), "0", concepts, randoms, runs=5, kind=kind)(randn(9, 5, seed=4), target=1)
    up, down = result.scores["up"]["0"], result.scores["down"]["0"]
    assert up.sign_counts.tolist() == [1.0] * 5 and down.sign_counts.tolist() == [0.0] * 5
    assert (up.sign_count, up.magnitude, down.sign_count, down.magnitude) == (1.0, 1.0, 0.0, 0.0)
    assert isinstance(result, TCAVResult) and isinstance(up, ConceptScore) and result.tests == 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_a_nonlinear_head_the_planted_concept_and_its_negation_are_both_significant(seed):
    model, inputs = nonlinear_head(seed), randn(40, 6, seed=10 + seed)
    u = planted(model, 2, inputs)
    concepts = {"up": randn(30, 6, seed=20 + seed) + 2 * u, "down": randn(30, 6, seed=30 + seed) - 2 * u}
    result = TCAV(model, "0", concepts, randn(300, 6, seed=40 + seed), runs=20, seed=seed)(inputs, target=2)
    up, down = result.scores["up"]["0"], result.scores["down"]["0"]
    assert up.sign_count > 0.9 and down.sign_count < 0.1
    assert up.p_value < 0.01 and down.p_value < 0.01 and up.significant and down.significant


@pytest.mark.parametrize("kind", ["mean", pytest.param("logistic", marks=pytest.mark.slow)])
def test_a_random_concept_is_not_significant_in_most_seeds(kind):
    """Many concept examples against fresh sets of 30 from the pool: the concept's own set, shared by all runs, then
    moves its scores little (with 30 concept examples, 7 of these 20 tests came out significant for "mean")."""
    significant, seeds = 0, 10 if kind == "mean" else 3  # the logistic fits cost seconds each: fewer seeds
    for seed in range(seeds):
        model, concepts = nonlinear_head(seed), {"random": randn(150, 6, seed=50 + seed)}
        pool = randn(300, 6, seed=60 + seed)
        tcav = TCAV(model, ["0", "2"], concepts, pool, runs=10, kind=kind, seed=seed, set_size=30)
        result = tcav(randn(40, 6, seed=70 + seed), target=0)
        significant += sum(result.scores["random"][layer].significant for layer in result.layers)
    assert significant <= 3 * seeds // 10  # of 2 x seeds tests; measured: 1 of 20 ("mean"), 0 of 6 ("logistic")


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy, on near-equal sign counts
def test_the_scores_are_the_formulas_on_the_directional_derivatives_recomputed_item_by_item():
    stats = pytest.importorskip("scipy.stats")
    model, inputs = small_cnn(), randn(7, 3, 7, 6, seed=80)
    concepts = {"bright": randn(8, 3, 7, 6, seed=81) + 1.0, "dark": randn(9, 3, 7, 6, seed=82) - 0.7}
    tcav = TCAV(model, ["1", "3"], concepts, randn(40, 3, 7, 6, seed=83), runs=4, kind="mean", batch_size=3)
    result = tcav(inputs, target=[2, 0, 1, 2, 2, 0, 1])
    for name in concepts:
        for layer, index in (("1", 2), ("3", 4)):
            score, vectors = result.scores[name][layer], torch.stack([c.vector for c in tcav.cavs[name][layer]])
            nulls = torch.stack([c.vector for c in tcav.random_cavs[layer]])
            slow, null = torch.zeros(4, 7, dtype=torch.float64), torch.zeros(4, 7, dtype=torch.float64)
            for item, target in enumerate([2, 0, 1, 2, 2, 0, 1]):
                acts = model[:index](inputs[item : item + 1]).detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(model[index:](acts)[0, target], acts)
                slow[:, item], null[:, item] = vectors @ grad.flatten(), nulls @ grad.flatten()
            assert score.random_sign_counts.tolist() == [sum(v > 0 for v in row) / 7 for row in null.tolist()]
            torch.testing.assert_close(score.derivatives, slow, rtol=1e-10, atol=1e-12)
            assert score.sign_counts.tolist() == [sum(v > 0 for v in row) / 7 for row in slow.tolist()]
            expected = [sum(max(v, 0) for v in row) / sum(abs(v) for v in row) for row in slow.tolist()]
            torch.testing.assert_close(score.magnitudes, torch.tensor(expected, dtype=torch.float64))
            assert score.sign_count == pytest.approx(sum(score.sign_counts.tolist()) / 4, rel=1e-14)
            p = stats.ttest_ind(score.sign_counts.numpy(), score.random_sign_counts.numpy()).pvalue
            assert score.p_value == pytest.approx(min(1.0, 4 * p), rel=1e-10)  # 2 concepts x 2 layers
            assert score.significant == (score.p_value < 0.05)


def test_mean_cavs_give_the_same_sign_counts_on_both_sides_of_a_linear_layer():
    """Layer 1 = W h0 + b: the mean CAV there is W times the one at layer 0, the gradient at 0 is W^T times the one at
    1, so each derivative is the same number up to the two vectors' lengths."""
    model, inputs = nonlinear_head(3), randn(30, 6, seed=150)
    concepts = {"c": randn(40, 6, seed=151) + 0.5, "d": randn(40, 6, seed=152) * 1.5}
    result = TCAV(model, ["0", "1"], concepts, randn(200, 6, seed=153), runs=4, kind="mean")(inputs, target=1)
    for name in concepts:
        at0, at1 = result.scores[name]["0"], result.scores[name]["1"]
        assert torch.equal(at0.sign_counts, at1.sign_counts)
        ratio = at0.derivatives / at1.derivatives  # one positive factor per run
        torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
        assert (ratio > 0).all()


def test_a_list_of_random_sets_follows_kim_et_al_and_equals_the_public_cav():
    model = small_cnn()
    concept, randoms = randn(6, 3, 7, 6, seed=90) + 1.0, [randn(5 + i, 3, 7, 6, seed=91 + i) for i in range(4)]
    tcav = TCAV(model, "2", {"bright": concept}, randoms, runs=3, seed=7)
    for i in range(3):
        run = cav(model, "2", concept, randoms[i + 1], seed=7 + i)
        torch.testing.assert_close(tcav.cavs["bright"]["2"][i].vector, run.vector, rtol=0, atol=1e-12)
        null = cav(model, "2", randoms[0], randoms[i + 1], seed=7 + i)
        torch.testing.assert_close(tcav.random_cavs["2"][i].vector, null.vector, rtol=0, atol=1e-12)


def test_a_pool_gives_each_run_three_disjoint_fresh_sets():
    runs = pool_runs(50, 7, runs=6, seed=3)
    for run in runs:
        rows = torch.cat([run.against, run.null_concept, run.null_against])
        assert len(run.against) == len(run.null_concept) == len(run.null_against) == 7 and len(set(rows.tolist())) == 21
    assert len({tuple(run.null_concept.tolist()) for run in runs}) == 6
    assert all(torch.equal(a.against, b.against) for a, b in zip(runs, pool_runs(50, 7, runs=6, seed=3), strict=True))


def test_scores_come_labelled_by_concept_and_layer_whatever_the_order_given():
    model, inputs = small_cnn(), randn(5, 3, 7, 6, seed=100)
    bright, dark = randn(8, 3, 7, 6, seed=101) + 1, randn(8, 3, 7, 6, seed=102) - 1
    pool = randn(30, 3, 7, 6, seed=103)
    one = TCAV(model, ["3", "1"], {"bright": bright, "dark": dark}, pool, runs=3, kind="mean")(inputs, 0)
    other = TCAV(model, ["1", "3"], {"dark": dark, "bright": bright}, pool, runs=3, kind="mean")(inputs, 0)
    assert one.layers == other.layers == ["1", "3"] and set(one.scores) == {"bright", "dark"}
    for name in ("bright", "dark"):
        for layer in ("1", "3"):
            assert torch.equal(one.scores[name][layer].derivatives, other.scores[name][layer].derivatives)
    assert not torch.equal(one.scores["bright"]["1"].derivatives, one.scores["dark"]["1"].derivatives)


def test_one_forward_per_batch_whatever_the_number_of_concepts_and_layers_and_the_batching_changes_nothing():
    model, inputs = small_cnn(), randn(7, 3, 7, 6, seed=110)
    concepts = {f"c{i}": randn(6, 3, 7, 6, seed=111 + i) + i for i in range(3)}
    tcav = TCAV(model, ["1", "3"], concepts, randn(30, 3, 7, 6, seed=120), runs=3, kind="mean", batch_size=3)
    _ = tcav.cavs
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        batched = tcav(inputs, target=None)
    finally:
        handle.remove()
    assert len(calls) == 3  # ceil(7 / 3) forwards (each with one backward), for 3 concepts x 2 layers x 4 CAV sets
    whole = TCAV(model, ["1", "3"], concepts, randn(30, 3, 7, 6, seed=120), runs=3, kind="mean")(inputs)
    for name in concepts:
        torch.testing.assert_close(batched.scores[name]["3"].derivatives, whole.scores[name]["3"].derivatives)


def test_the_model_is_left_as_found_also_when_the_call_raises():
    model = small_cnn().train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    x = randn(4, 3, 7, 6, seed=130)
    before = model(x).detach().clone()
    tcav = TCAV(model, ["1", "3"], {"b": randn(6, 3, 7, 6, seed=131) + 1}, randn(30, 3, 7, 6, seed=132), runs=2)
    tcav(x, target=1)
    with pytest.raises(ValueError, match="inputs"):
        tcav(randn(4, 3, 9, 6, seed=133), target=1)
    assert model.training and all(m.training for m in model.modules())
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert torch.equal(model[2].weight.grad, torch.ones_like(model[2].weight)) and model[0].bias.grad is None
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    assert torch.equal(model(x), before)


def test_bad_input_is_refused_naming_the_cause():
    model, pool = small_cnn(), randn(30, 3, 7, 6, seed=140)
    concept = {"b": randn(6, 3, 7, 6, seed=141)}
    with pytest.raises(ValueError, match=r"list of 3 example sets, but runs=3 needs at least 4"):
        TCAV(model, "1", concept, list(pool.split(10)), runs=3)
    with pytest.raises(KeyError, match="conv9"):
        TCAV(model, ["1", "conv9"], concept, pool)
    with pytest.raises(ValueError, match=r"concept 'one' holds 1 example"):
        TCAV(model, "1", {"one": pool[:1]}, pool, runs=2)(pool[:2])
    with pytest.raises(ValueError, match=r"concept 'small' gives activations of shape \(4, 5, 6\).*concept 'b'"):
        TCAV(model, "1", {**concept, "small": randn(6, 3, 5, 6, seed=142)}, pool, runs=2)(pool[:2])
    with pytest.raises(ValueError, match=r"`inputs` give activations of 120 values.*168"):
        TCAV(model, "1", concept, pool, runs=2, kind="mean")(randn(2, 3, 5, 6, seed=143))
    with pytest.raises(ValueError, match=r"pool of 30 examples.*three disjoint sets of 11.*at least 33"):
        TCAV(model, "1", concept, pool, runs=2, set_size=11)(pool[:2])
    with pytest.raises(ValueError, match="`runs` must be an integer of at least 2"):
        TCAV(model, "1", concept, pool, runs=1)
    with pytest.raises(ValueError, match="`target` has 3 entries but the batch has 2"):
        TCAV(model, "1", concept, pool, runs=2)(pool[:2], target=[0, 1, 2])
