"""Probes: known answers on planted directions, the control task's wiring, the causal check by hand, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.probes import causal_check, probe
from attribution.probes._fit import fit_linear

D = 6


def planted(n: int = 2000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``noise + (2y - 1) * 1.5 * u`` for a fixed non-axis unit vector ``u``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.tensor([0.5, -0.3, 0.1, 0.7, -0.2, 0.35], dtype=torch.float64)
    u = u / u.norm()
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) + (2 * y - 1)[:, None] * 1.5 * u
    return x, y, u


def identity_then_head(head: torch.Tensor, bias: float = 0.25) -> nn.Module:
    """``"0"``: an identity Linear (the probed site); ``"1"``: a one-output head with weight ``head``."""
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, 1)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(D))
        model[0].bias.zero_()
        model[1].weight.copy_(head[None])
        model[1].bias.fill_(bias)
    return model


def test_a_planted_direction_is_recovered_and_points_towards_class_one():
    x, y, u = planted()
    result = probe(nn.Sequential(nn.Identity()), x, y, "0")
    cosine = float(result.direction["0"] @ u)
    assert cosine >= 0.99
    assert result.accuracy["0"] > 0.9
    # rows are their own type: the control task is memorising random labels, chance on held-out rows
    assert abs(result.control_accuracy["0"] - 0.5) < 0.06
    assert result.selectivity["0"] == pytest.approx(result.accuracy["0"] - result.control_accuracy["0"])
    # the gap is the distance of the class means along the direction: 2 * 1.5 * cosine, up to sampling
    assert result.gap["0"] == pytest.approx(3.0 * cosine, abs=0.15)


def test_the_linear_fit_is_the_optimum_of_its_objective_in_the_activations_coordinates():
    x, y, _ = planted(300, seed=1)
    x = x * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0, 0.5], dtype=torch.float64) + 4.0  # unequal scales and offsets
    fitted = fit_linear(x, y, 2, l2=1e-2)
    mean, std = x.mean(0), x.std(0, unbiased=False)
    z = (x - mean) / std
    w, b = fitted.weight * std, fitted.bias + mean @ fitted.weight.T  # back to the standardised coordinates
    assert torch.allclose(z @ w.T + b, fitted(x), atol=1e-10)
    p = torch.softmax(z @ w.T + b, dim=1)
    residual = p - torch.nn.functional.one_hot(y, 2).double()
    grad_w = residual.T @ z / len(y) + 1e-2 * w  # the objective's gradient, written out: zero at the optimum
    grad_b = residual.mean(0)
    assert grad_w.abs().max() < 1e-7 and grad_b.abs().max() < 1e-7


def test_random_labels_give_no_selectivity():
    x, _, _ = planted(2000, seed=2)
    y = torch.randint(0, 2, (2000,), generator=torch.Generator().manual_seed(9))
    result = probe(nn.Sequential(nn.Identity()), x, y, "0")
    assert abs(result.accuracy["0"] - 0.5) < 0.06
    assert abs(result.selectivity["0"]) < 0.08


def test_the_control_task_labels_word_types_so_a_lexical_property_has_no_selectivity():
    torch.manual_seed(0)
    vocab, tokens = 24, 5
    model = nn.Sequential(nn.Embedding(vocab, 48)).double()
    ids = torch.randint(0, vocab, (1200, tokens), generator=torch.Generator().manual_seed(3))
    table = torch.randint(0, 2, (vocab,), generator=torch.Generator().manual_seed(4))
    labels = table[ids[:, 2]]  # a property of the word at position 2 alone
    result = probe(model, ids, labels, "0", position=2)
    assert result.accuracy["0"] > 0.97
    # the control task gives each token id one random label: as learnable as the property, so selectivity ~ 0
    # (with the rows as their own types it would be chance, 0.5)
    assert result.control_accuracy["0"] > 0.97
    assert abs(result.selectivity["0"]) < 0.03


def test_every_token_is_a_row_with_position_none():
    vocab = 16
    model = nn.Sequential(nn.Embedding(vocab, 32)).double()
    ids = torch.randint(0, vocab, (300, 4), generator=torch.Generator().manual_seed(5))
    labels = (ids % 2 == 1).long()  # (items, tokens)
    result = probe(model, ids, labels, "0", position=None, control=False)
    assert result.accuracy["0"] > 0.97
    assert result.control_accuracy["0"] != result.control_accuracy["0"]  # nan without the control task
    with pytest.raises(ValueError, match="1200 rows"):
        probe(model, ids, labels[:, 0], "0", position=None)


def test_an_mlp_probe_reads_what_a_linear_one_cannot():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(800, 2, generator=g, dtype=torch.float64)
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()  # XOR
    linear = probe(nn.Sequential(nn.Identity()), x, y, "0", control=False)
    mlp = probe(nn.Sequential(nn.Identity()), x, y, "0", kind="mlp", control=False)
    assert linear.accuracy["0"] < 0.65 < 0.9 < mlp.accuracy["0"]
    assert mlp.direction["0"].shape == (2,)


def test_ablating_the_direction_changes_the_output_by_the_head_s_share_of_it():
    x, y, _ = planted(400, seed=7)
    head = torch.tensor([0.3, -1.0, 0.2, 0.5, 0.0, 0.8], dtype=torch.float64)
    model = identity_then_head(head)
    result = probe(model, x, y, "0")
    u = result.direction["0"]
    change = causal_check(model, result, "0", x, lambda out: out[:, 0])
    assert change == pytest.approx(float(-((x @ u) * (head @ u)).mean()), rel=1e-10, abs=1e-12)
    steered = causal_check(model, result, "0", x, lambda out: out[:, 0], how="steer")
    assert steered == pytest.approx(result.gap["0"] * float(head @ u), rel=1e-10)
    blind = head - (head @ u) * u  # a head that does not read the direction: no effect either way
    for how in ("ablate", "steer"):
        assert abs(causal_check(identity_then_head(blind), result, "0", x, lambda out: out[:, 0], how=how)) < 1e-12


def test_the_check_intervenes_at_the_probed_position_only():
    class LastToken(nn.Module):
        def __init__(self, head: torch.Tensor) -> None:
            super().__init__()
            self.site = nn.Identity()
            self.head = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.site(x)[:, -1] @ self.head  # reads the last position alone

    g = torch.Generator().manual_seed(8)
    y = torch.randint(0, 2, (300,), generator=g)
    x = torch.randn(300, 3, D, generator=g, dtype=torch.float64)
    x[:, 0] += (2 * y - 1)[:, None] * 2.0  # the property lives at position 0
    head = torch.linspace(-1, 1, D, dtype=torch.float64)
    model = LastToken(head)
    first = probe(model, x, y, "site", position=0)
    assert first.accuracy["site"] > 0.95
    assert abs(causal_check(model, first, "site", x, lambda out: out, how="steer", scale=5.0)) < 1e-12
    last = probe(model, x, y, "site", position=-1)
    u = last.direction["site"]
    assert causal_check(model, last, "site", x, lambda out: out, how="steer", scale=5.0) == pytest.approx(
        5.0 * float(head @ u), rel=1e-10
    )


def test_three_classes_ablate_the_span_of_their_directions():
    g = torch.Generator().manual_seed(10)
    y = torch.randint(0, 3, (900,), generator=g)
    centres = torch.tensor([[3.0, 0, 0, 0, 0, 0], [0, 3.0, 0, 0, 0, 0], [0, 0, 0, 3.0, 0, 0]], dtype=torch.float64)
    x = torch.randn(900, D, generator=g, dtype=torch.float64) + centres[y]
    result = probe(nn.Sequential(nn.Identity()), x, y, "0")
    rows = result.direction["0"]
    assert rows.shape == (3, D) and torch.allclose(rows.norm(dim=1), torch.ones(3, dtype=torch.float64))
    head = rows[0] + 0.5 * rows[2]  # a head inside the span: ablation leaves it reading only its bias
    model = identity_then_head(head, bias=0.25)
    clean = float((x @ head).mean() + 0.25)
    assert causal_check(model, result, "0", x, lambda out: out[:, 0]) == pytest.approx(0.25 - clean, abs=1e-10)
    with pytest.raises(ValueError, match="one direction"):
        causal_check(model, result, "0", x, lambda out: out[:, 0], how="steer")


def test_the_model_is_left_as_found_and_the_outputs_are_unchanged():
    x, y, _ = planted(200, seed=11)
    model = identity_then_head(torch.ones(D, dtype=torch.float64)).train()
    model[1].weight.requires_grad_(False)
    before = model(x)
    result = probe(model, x, y, "0")
    causal_check(model, result, "0", x, lambda out: out[:, 0])
    assert model.training and not model[1].weight.requires_grad and model[0].weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(model(x), before)


def test_the_same_seed_gives_the_same_probe():
    x, y, _ = planted(300, seed=12)
    a, b = (probe(nn.Sequential(nn.Identity()), x, y, "0", seed=3) for _ in range(2))
    assert torch.equal(a.direction["0"], b.direction["0"]) and a.control_accuracy == b.control_accuracy


def test_bad_input_is_named():
    x, y, _ = planted(100, seed=13)
    model = nn.Sequential(nn.Identity())
    with pytest.raises(ValueError, match="100 rows"):
        probe(model, x, y[:50], "0")
    with pytest.raises(ValueError, match="one class"):
        probe(model, x, torch.zeros(100, dtype=torch.long), "0")
    with pytest.raises(TypeError, match="integer tensor"):
        probe(model, x, y.double(), "0")
    with pytest.raises(ValueError, match="'linear' or 'mlp'"):
        probe(model, x, y, "0", kind="svm")  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        probe(model, x, y, "1")
    result = probe(model, x, y, "0")
    with pytest.raises(KeyError, match="not one of the probe's sites"):
        causal_check(model, result, "1", x, lambda out: out[:, 0])
    with pytest.raises(ValueError, match="'ablate' or 'steer'"):
        causal_check(model, result, "0", x, lambda out: out[:, 0], how="patch")  # type: ignore[arg-type]


def test_keyword_inputs_are_cut_into_batches_and_their_other_values_passed_on():
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 16).double()

        def forward(self, input_ids: torch.Tensor, use_cache: bool) -> torch.Tensor:
            assert use_cache is False
            return self.embed(input_ids)

    ids = torch.randint(0, 10, (90, 3), generator=torch.Generator().manual_seed(14))
    labels = (ids[:, -1] > 4).long()
    result = probe(Keywords(), {"input_ids": ids, "use_cache": False}, labels, "embed", batch_size=16)
    assert result.accuracy["embed"] == 1.0 and result.control_accuracy["embed"] > 0.9  # token ids as types


def test_a_clean_value_given_is_used_instead_of_a_clean_run():
    x, y, _ = planted(200, seed=15)
    model = identity_then_head(torch.ones(D, dtype=torch.float64))
    result = probe(model, x, y, "0")
    measured = causal_check(model, result, "0", x, lambda out: out[:, 0])
    clean = float(model(x)[:, 0].mean())
    assert causal_check(model, result, "0", x, lambda out: out[:, 0], clean=clean) == pytest.approx(measured, abs=1e-12)
    assert causal_check(model, result, "0", x, lambda out: out[:, 0], clean=clean + 1.0) == pytest.approx(measured - 1)


def test_a_metric_that_raises_leaves_no_hook_behind():
    x, y, _ = planted(100, seed=16)
    model = identity_then_head(torch.ones(D, dtype=torch.float64))
    result = probe(model, x, y, "0")

    def broken(out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        causal_check(model, result, "0", x, broken, clean=0.0)  # fails inside the intervened run
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(model(x), identity_then_head(torch.ones(D, dtype=torch.float64))(x))
