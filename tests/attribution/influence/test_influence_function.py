"""InfluenceFunction: closed forms, dense K-FAC/EK-FAC/diagonal, leave-one-out retraining, signs, state (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.influence import InfluenceFunction

CE = nn.CrossEntropyLoss(reduction="none")
MSE = nn.MSELoss(reduction="none")


def _regression(n: int = 12, d: int = 3, seed: int = 0) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A bias-free linear model whose residuals are all +-1/sqrt(2): the empirical Fisher is the Hessian."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.7, -1.3, 0.4]], dtype=torch.float64))
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    signs = (torch.randint(0, 2, (n, 1), generator=g) * 2 - 1).double()
    y = model(x).detach() - signs * 0.5**0.5
    return model, x, y


def _classifier(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    return model, (x, torch.randint(0, 3, (20,), generator=g))


def test_exact_equals_the_closed_form_of_linear_regression() -> None:
    model, x, y = _regression()
    damping = 0.25
    ours = InfluenceFunction(model, MSE, method="exact", damping=damping).fit((x, y)).scores((x[:3], y[:3]), (x, y))
    w = model.weight.detach()[0]
    g = 2 * (x @ w - y[:, 0])[:, None] * x  # the gradient of (w.x - y)^2
    hessian = 2 * x.T @ x / len(x) + damping * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(ours, g[:3] @ torch.linalg.solve(hessian, g.T), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_and_ekfac_equal_exact_when_the_empirical_fisher_is_the_hessian(method: str) -> None:
    model, x, y = _regression()
    exact = InfluenceFunction(model, MSE, method="exact", damping=1e-3).fit((x, y))
    ours = InfluenceFunction(model, MSE, method=method, damping=1e-3, fisher="empirical").fit((x, y))
    torch.testing.assert_close(ours.scores((x, y), (x, y)), exact.scores((x, y), (x, y)), rtol=1e-9, atol=1e-12)


def _per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A slow loop of single-example gradients, flattened in parameter order."""
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(CE(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def test_diagonal_is_the_damped_mean_squared_gradient() -> None:
    model, (x, y) = _classifier()
    ours = InfluenceFunction(model, CE, method="diagonal", damping=0.1, fisher="empirical").fit((x, y))
    g = _per_example(model, x, y)
    expected = (g[:4] / ((g**2).mean(0) + 0.1)) @ g.T
    torch.testing.assert_close(ours.scores((x[:4], y[:4]), (x, y)), expected, rtol=1e-10, atol=1e-12)


def _kfac_by_hand(model: nn.Linear, x: torch.Tensor, y: torch.Tensor, refit: bool, damping: float) -> torch.Tensor:
    """``(A (x) S + damping)^-1`` for one Linear with bias under cross-entropy, written densely."""
    a = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    delta = torch.softmax(model(x), -1).detach() - nn.functional.one_hot(y, 3).double()
    big_a, big_s = a.T @ a / len(x), delta.T @ delta / len(x)
    _, q_a = torch.linalg.eigh(big_a)
    _, q_s = torch.linalg.eigh(big_s)
    basis = torch.kron(q_a, q_s)  # on column-stacked vec(G), G = delta a^T of shape (3, 4)
    vecs = torch.stack([torch.outer(delta[i], a[i]).T.reshape(-1) for i in range(len(x))])
    if refit:
        values = ((vecs @ basis) ** 2).mean(0)
    else:
        values = torch.diagonal(basis.T @ torch.kron(big_a, big_s) @ basis)
    inverse = basis @ torch.diag(1 / (values + damping)) @ basis.T
    return vecs @ inverse @ vecs.T


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_and_ekfac_equal_their_dense_formulas_on_a_linear_with_cross_entropy(method: str) -> None:
    g = torch.Generator().manual_seed(3)
    model = nn.Linear(3, 3).double()
    x = torch.randn(15, 3, generator=g, dtype=torch.float64) * torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)
    y = torch.randint(0, 3, (15,), generator=g)
    ours = InfluenceFunction(model, CE, method=method, damping=0.05, fisher="empirical").fit((x, y))
    expected = _kfac_by_hand(model, x, y, refit=method == "ekfac", damping=0.05)
    # scores are inner products: the dense form's column-stacked vec([W | b]) gives the same numbers as ours
    torch.testing.assert_close(ours.scores((x, y), (x, y)), expected, rtol=1e-9, atol=1e-12)


def _fit_logistic(x: torch.Tensor, y: torch.Tensor, reg: float, start: nn.Module) -> nn.Module:
    model = nn.Linear(x.shape[1], 2).double()
    model.load_state_dict(start.state_dict())
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=500, tolerance_grad=1e-13, tolerance_change=1e-15)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = CE(model(x), y).mean() + reg / 2 * sum((p**2).sum() for p in model.parameters())
        value.backward()
        return value

    for _ in range(3):
        optimizer.step(closure)
    return model


@pytest.mark.slow
def test_exact_influence_predicts_leave_one_out_retraining_of_logistic_regression() -> None:
    """Koh & Liang's check: the score / n against the test loss change after refitting without the example."""
    g = torch.Generator().manual_seed(5)
    n, reg = 30, 0.05
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = ((x @ torch.tensor([1.5, -2.0, 0.5], dtype=torch.float64) + torch.randn(n, generator=g).double()) > 0).long()
    start = nn.Linear(3, 2).double()
    model = _fit_logistic(x, y, reg, start)
    xt, yt = x[:1] * -0.8 + 0.3, y[:1] * 0 + 1
    scores = InfluenceFunction(model, CE, method="exact", damping=reg).fit((x, y)).scores((xt, yt), (x, y))[0]
    base = CE(model(xt), yt).item()
    changes = []
    for j in range(n):
        keep = torch.arange(n) != j
        changes.append(CE(_fit_logistic(x[keep], y[keep], reg, model)(xt), yt).item() - base)
    pearson = torch.corrcoef(torch.stack([scores / n, torch.tensor(changes, dtype=torch.float64)]))[0, 1]
    assert pearson > 0.99, pearson


@pytest.mark.parametrize("method", ["identity", "diagonal", "kfac", "ekfac", "exact"])
def test_a_duplicate_is_the_top_proponent_and_a_relabelled_copy_the_top_opponent(method: str) -> None:
    model, (x, y) = _classifier(seed=2)
    test = (x[:1], y[:1])
    train_x = torch.cat([x[1:], x[:1], x[:1]])
    train_y = torch.cat([y[1:], y[:1], (y[:1] + 1) % 3])
    damping = 1.0 if method == "exact" else 0.01  # an untrained MLP's Hessian has eigenvalues down to -0.42
    influence = InfluenceFunction(model, CE, method=method, damping=damping).fit((train_x, train_y))
    scores = influence.scores(test, (train_x, train_y))[0]
    assert scores.argmax().item() == len(train_x) - 2 and scores.max() > 0
    assert scores.argmin().item() == len(train_x) - 1 and scores.min() < 0


def test_scores_are_the_same_from_a_loader_and_self_influence_is_the_diagonal(tmp_path) -> None:
    model, (x, y) = _classifier()
    influence = InfluenceFunction(model, CE, method="ekfac").fit((x, y))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=7)
    whole = influence.scores((x, y), (x, y))
    torch.testing.assert_close(influence.scores(loader, loader), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(influence.self_influence(loader), torch.diagonal(whole), rtol=1e-12, atol=1e-14)
    values, _ = influence.top((x[:2], y[:2]), (x, y), k=3, proponents=False)
    torch.testing.assert_close(values, whole[:2].sort(dim=1).values[:, :3])
    influence.save(tmp_path / "f.pt")
    loaded = InfluenceFunction.load(tmp_path / "f.pt", model, CE)
    torch.testing.assert_close(loaded.scores((x, y), (x, y)), whole, rtol=0, atol=0)


def test_sampled_fisher_is_seeded_and_differs_from_the_empirical_one() -> None:
    model, (x, y) = _classifier()
    first = InfluenceFunction(model, CE, method="kfac", seed=1).fit((x, y)).scores((x, y), (x, y))
    again = InfluenceFunction(model, CE, method="kfac", seed=1).fit((x, y)).scores((x, y), (x, y))
    empirical = InfluenceFunction(model, CE, method="kfac", fisher="empirical").fit((x, y)).scores((x, y), (x, y))
    assert torch.equal(first, again) and not torch.allclose(first, empirical)


def test_ekfac_correlates_with_exact_on_a_trained_mlp() -> None:
    """Pearson 0.865 here (seeds 0-3: 0.80, 0.87, 0.84, 0.79 for EK-FAC; K-FAC 0.84, 0.86, 0.75, 0.80; identity 0.83,
    0.87, 0.69, 0.76), damping 0.01 for all; the exact Hessian uses the true labels, EK-FAC the sampled Fisher."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(3, 3, generator=g, dtype=torch.float64)).argmax(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(300):
        optimizer.zero_grad()
        (CE(model(x), y).mean() + 1e-3 * sum((p**2).sum() for p in model.parameters())).backward()
        optimizer.step()
    exact = InfluenceFunction(model, CE, method="exact", damping=0.01).fit((x, y)).scores((x[:8], y[:8]), (x, y))
    ekfac = InfluenceFunction(model, CE, method="ekfac", damping=0.01).fit((x, y)).scores((x[:8], y[:8]), (x, y))
    pearson = torch.corrcoef(torch.stack([exact.flatten(), ekfac.flatten()]))[0, 1]
    assert pearson > 0.85, pearson


def test_the_model_is_left_as_found() -> None:
    model, (x, y) = _classifier()
    model.train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    InfluenceFunction(model, CE, method="ekfac").fit((x, y)).scores((x, y), (x, y))
    assert model.training and not model[0].weight.requires_grad and torch.equal(model[2].weight.grad, torch.ones(3, 4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._backward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bad_input_is_refused_with_the_cause() -> None:
    model, (x, y) = _classifier()
    with pytest.raises(ValueError, match="`method` must be one of"):
        InfluenceFunction(model, CE, method="lissa")
    with pytest.raises(ValueError, match="fisher='empirical'"):
        InfluenceFunction(model, lambda out, batch: CE(out, batch[1]), method="kfac")
    with pytest.raises(RuntimeError, match="fit"):
        InfluenceFunction(model, CE, method="kfac").scores((x, y), (x, y))
    embedded = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="Kronecker block"):
        InfluenceFunction(embedded, CE, method="ekfac")
    with pytest.raises(ValueError, match="reduction"):
        InfluenceFunction(model, nn.CrossEntropyLoss(), method="identity")


def _sequence_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return CE(out.transpose(1, 2), batch[1]).sum(1)


def test_kfac_on_sequences_averages_inputs_over_positions_and_sums_output_gradients_per_example() -> None:
    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 3)).double()
    x = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6, 4), generator=g)
    ours = InfluenceFunction(model, _sequence_loss, method="kfac", damping=0.1, fisher="empirical").fit((x, y))
    a = torch.cat([x, torch.ones(6, 4, 1, dtype=torch.float64)], dim=-1)
    delta = torch.softmax(model(x), -1).detach() - nn.functional.one_hot(y, 3).double()
    big_a = torch.einsum("bti,btj->ij", a, a) / 24
    big_s = torch.einsum("bti,btj->ij", delta, delta) / 6
    vecs = torch.einsum("bto,bti->bio", delta, a).reshape(6, -1)  # column-stacked vec(sum_t delta_t a_t^T)
    dense = torch.kron(big_a, big_s) + 0.1 * torch.eye(12, dtype=torch.float64)
    expected = vecs @ torch.linalg.solve(dense, vecs.T)
    torch.testing.assert_close(ours.scores((x, y), (x, y)), expected, rtol=1e-9, atol=1e-12)


def test_ekfac_on_a_tiny_llamas_mlps_with_labels_sampled_per_position() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, 30, (6, 7), generator=torch.Generator().manual_seed(1))

    def loss(out: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = out.logits[:, :-1]  # type: ignore[attr-defined]
        return CE(logits.transpose(1, 2), batch["labels"][:, 1:]).sum(1)

    def sample(out: object, batch: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        probabilities = torch.softmax(out.logits.detach(), -1).flatten(0, 1)  # type: ignore[attr-defined]
        return torch.multinomial(probabilities, 1, generator=generator).view(batch["labels"].shape)

    train = {"input_ids": torch.cat([ids, ids[:1]]), "labels": torch.cat([ids, ids[:1]])}
    influence = InfluenceFunction(model, loss, modules="model.layers.*.mlp.*", sample_labels=sample).fit(train)
    scores = influence.scores({"input_ids": ids[:1], "labels": ids[:1]}, train)[0]
    assert scores.shape == (7,) and scores[0] > 0 and scores[6] > 0
    assert set(scores.topk(2).indices.tolist()) == {0, 6}  # the example and its duplicate


def test_default_damping_is_a_tenth_of_the_mean_eigenvalue() -> None:
    model, (x, y) = _classifier()
    single = model[2]
    h = model[1](model[0](x)).detach()
    fitted = InfluenceFunction(nn.Sequential(single), CE, method="kfac", fisher="empirical").fit((h, y))
    a = torch.cat([h, torch.ones(len(h), 1, dtype=torch.float64)], dim=1)
    delta = torch.softmax(single(h), -1).detach() - nn.functional.one_hot(y, 3).double()
    mean_eigenvalue = torch.trace(a.T @ a / len(h)) / 5 * torch.trace(delta.T @ delta / len(h)) / 3
    explicit = InfluenceFunction(
        nn.Sequential(single), CE, method="kfac", damping=0.1 * mean_eigenvalue.item(), fisher="empirical"
    )
    torch.testing.assert_close(
        fitted.scores((h, y), (h, y)), explicit.fit((h, y)).scores((h, y), (h, y)), rtol=1e-10, atol=1e-12
    )


def test_sampled_labels_follow_the_models_distribution() -> None:
    """Categorical for cross-entropy; for squared error a Gaussian of variance 1/2, so E[delta^2] = 2 = the Hessian."""
    from attribution.influence._fisher import sampled

    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64).expand(40_000, 3)
    counts = torch.bincount(sampled(logits, CE, g), minlength=3) / 40_000
    torch.testing.assert_close(counts, torch.softmax(logits[0], -1).float(), rtol=0, atol=0.01)
    outputs = torch.full((40_000, 1), 3.0, dtype=torch.float64)
    delta = 2 * (outputs - sampled(outputs, MSE, g))
    assert abs((delta**2).mean().item() - 2) < 0.05 and abs(delta.mean().item()) < 0.03
