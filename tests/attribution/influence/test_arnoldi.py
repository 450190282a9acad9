"""method="arnoldi": "exact" on the whole space, the explicit Hessian's top eigenpairs, captum's scores (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.influence import InfluenceFunction
from attribution.influence._arnoldi import arnoldi, top_eigenpairs

CE = nn.CrossEntropyLoss(reduction="none")


def squared_error(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A per-example squared error summed over 2 outputs."""
    return ((outputs - batch[1]) ** 2).sum(1)


def _trained(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> nn.Module:  # type: ignore[no-untyped-def]
    """``model`` at a minimum of its mean training loss (L-BFGS), ``.grad`` cleared."""
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=300, tolerance_grad=1e-12, tolerance_change=1e-15)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = loss(model(x), (x, y)).mean()
        value.backward()
        return value

    optimizer.step(closure)
    for p in model.parameters():
        p.grad = None
    return model


def _regression() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 3-4-2 tanh MLP (26 parameters) fitted to 30 random targets: its Hessian is positive definite."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.randn(30, 2, generator=g, dtype=torch.float64)
    return _trained(model, squared_error, x, y), (x, y)


def _classifier() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 5-8-3 tanh MLP (75 parameters) trained with cross-entropy on 40 examples."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=g)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        optimizer.zero_grad()
        CE(model(x), y).mean().backward()
        optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, (x, y)


def _untrained() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """An untrained 3-4-3 tanh MLP (31 parameters) and 20 examples: its Hessian has negative eigenvalues."""
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    return model, (torch.randn(20, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (20,), generator=g))


def _explicit_hessian(model: nn.Module, loss, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The Hessian of the mean loss in all parameters, flattened in order, by torch.func.hessian (slow reference)."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def mean_loss(vector: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, torch.split(vector, [s.numel() for s in shapes]), strict=True))
        tensors = {name: pieces[name].view(shape) for name, shape in zip(names, shapes, strict=True)}
        return loss(torch.func.functional_call(model, tensors, (batch[0],)), batch).mean()  # type: ignore[no-any-return]

    return torch.func.hessian(mean_loss)(flat)


# -- the pure iteration ------------------------------------------------------------------------------------------
def test_the_iteration_stops_on_an_invariant_space_with_the_exact_eigenvalues() -> None:
    """A 12 x 12 matrix with 3 distinct eigenvalues: its Krylov spaces have dimension 3, whatever the start."""
    g = torch.Generator().manual_seed(1)
    rotation, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    spectrum = torch.tensor([5.0] * 4 + [2.0] * 5 + [-1.0] * 3, dtype=torch.float64)
    matrix = rotation @ torch.diag(spectrum) @ rotation.T
    basis, restricted = arnoldi(lambda v: matrix @ v, torch.randn(12, generator=g, dtype=torch.float64), steps=10)
    assert basis.shape == (12, 3) and restricted.shape == (3, 3)
    torch.testing.assert_close(basis.T @ basis, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-14)
    values, vectors = top_eigenpairs(basis, restricted, k=5)  # only 3 exist in the space
    torch.testing.assert_close(values, torch.tensor([5.0, 2.0, -1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(matrix @ vectors, vectors * values, rtol=0, atol=1e-12)


def test_the_restricted_matrix_is_the_projection_of_the_operator() -> None:
    g = torch.Generator().manual_seed(2)
    half = torch.randn(30, 30, generator=g, dtype=torch.float64)
    matrix = half @ half.T / 30
    basis, restricted = arnoldi(lambda v: matrix @ v, torch.randn(30, generator=g, dtype=torch.float64), steps=8)
    assert basis.shape == (30, 8)
    torch.testing.assert_close(restricted, basis.T @ matrix @ basis, rtol=0, atol=1e-13)
    values, _ = top_eigenpairs(basis, restricted, k=3)
    assert torch.all(values[:-1] >= values[1:])  # descending


# -- through InfluenceFunction -----------------------------------------------------------------------------------
@pytest.mark.parametrize("damping", [0.5, None])
def test_equals_exact_when_the_krylov_space_is_the_whole_parameter_space(damping: float | None) -> None:
    """26 parameters, arnoldi_dim 30: the space closes at 26 and every eigenpair is kept (default damping included:
    the mean of the kept eigenvalues is then the mean of all). 2e-14 relative here."""
    model, data = _regression()
    exact = InfluenceFunction(model, squared_error, method="exact", damping=damping).fit(data)
    ours = InfluenceFunction(model, squared_error, method="arnoldi", damping=damping, arnoldi_dim=30, projection_dim=30)
    ours.fit(data)
    assert ours.state["eigenvalues"].shape == (26,)
    test = (data[0][:5], data[1][:5])
    torch.testing.assert_close(ours.scores(test, data), exact.scores(test, data), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(ours.self_influence(data), exact.self_influence(data), rtol=1e-8, atol=1e-10)


def test_the_top_eigenpairs_are_those_of_the_explicit_hessian() -> None:
    """30 Arnoldi steps on 75 parameters: the 5 largest eigenvalues (0.21 to 0.047) agree to 4e-15 relative here."""
    model, data = _classifier()
    hessian = _explicit_hessian(model, lambda out, batch: CE(out, batch[1]), data)
    values, vectors = torch.linalg.eigh(hessian)
    ours = InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=30, projection_dim=5).fit(data)
    torch.testing.assert_close(ours.state["eigenvalues"], values.flip(0)[:5], rtol=1e-11, atol=0)
    overlaps = (ours.state["eigenvectors"].T @ vectors.flip(1)[:, :5]).abs()
    torch.testing.assert_close(overlaps, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.peers
@pytest.mark.slow
def test_equals_captum_arnoldi_influence_function(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """captum 0.9 on the same model, data, seed and Krylov space, with its conventions mapped onto ours.

    captum's Hessian is that of the *summed* loss (n times ours) and its ``hessian_reg`` is added to it: our
    ``damping`` is ``hessian_reg / n`` and our scores are n times captum's. captum runs ``arnoldi_dim`` products but
    keeps ``arnoldi_dim - 1`` basis vectors: ours with ``arnoldi_dim=m`` is captum's with ``m + 1``. Its start vector
    is ``torch.randn_like`` per parameter after ``torch.manual_seed(seed)``, ours the same numbers from a generator
    of our own. captum adds ``hessian_reg`` through a float32 identity, so the damping here (0.0125 x 40 = 0.5) is
    exact in float32. Agreement: 2e-13 relative; 1e-10 asserted. 20 of the 75 dimensions: the space is not closed,
    so the start vector and every step matter.
    """
    captum = pytest.importorskip("captum.influence._core.arnoldi_influence_function")
    model, (x, y) = _classifier()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    ours = InfluenceFunction(model, CE, method="arnoldi", damping=0.0125, arnoldi_dim=20, projection_dim=10, seed=3)
    expected = ours.fit((x, y)).scores((x[:6], y[:6]), (x, y))
    with torch.random.fork_rng():  # captum seeds the global generator
        reference = captum.ArnoldiInfluenceFunction(
            model,
            torch.utils.data.TensorDataset(x, y),
            str(path),
            loss_fn=CE,
            batch_size=16,
            projection_dim=10,
            seed=3,
            arnoldi_dim=21,
            arnoldi_tol=1e-14,
            hessian_reg=0.0125 * 40,
        )
        theirs = reference.influence((x[:6], y[:6])) * 40
    torch.testing.assert_close(expected, theirs, rtol=1e-10, atol=1e-10 * float(theirs.abs().max()))


def test_the_seed_draws_the_start_vector() -> None:
    model, data = _classifier()
    scores = [
        InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=8, projection_dim=4, seed=seed)
        .fit(data)
        .scores(data, data)
        for seed in (0, 0, 1)
    ]
    assert torch.equal(scores[0], scores[1]) and not torch.allclose(scores[0], scores[2])


@pytest.mark.parametrize("projection_dim", [31, 15])
def test_a_duplicate_is_the_top_proponent_and_a_relabelled_copy_the_top_opponent(projection_dim: int) -> None:
    """An untrained 3-4-3 MLP (31 parameters, a Krylov space of 27): with every eigenpair kept the damping must cover
    the Hessian's negative eigenvalues (down to -0.42, as for "exact"); the top 15 are the positive ones, and the
    default damping does. (With 5 or fewer kept, most of each gradient is dropped and the duplicate is not the top
    proponent on this model: the scores are then a rank-5 similarity.)"""
    model, (x, y) = _untrained()
    train = (torch.cat([x[1:], x[:1], x[:1]]), torch.cat([y[1:], y[:1], (y[:1] + 1) % 3]))
    damping = 1.0 if projection_dim == 31 else None
    influence = InfluenceFunction(model, CE, method="arnoldi", damping=damping, projection_dim=projection_dim)
    scores = influence.fit(train).scores((x[:1], y[:1]), train)[0]
    assert scores.argmax().item() == len(train[0]) - 2 and scores.max() > 0
    assert scores.argmin().item() == len(train[0]) - 1 and scores.min() < 0


def test_save_and_load_keep_the_settings_and_the_eigenpairs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, data = _classifier()
    influence = InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=12, projection_dim=6, seed=4).fit(data)
    influence.save(tmp_path / "arnoldi.pt")
    loaded = InfluenceFunction.load(tmp_path / "arnoldi.pt", model, CE)
    assert (loaded.method, loaded.arnoldi_dim, loaded.projection_dim, loaded.seed) == ("arnoldi", 12, 6, 4)
    assert torch.equal(loaded.scores(data, data), influence.scores(data, data))


def test_the_model_is_left_as_found_also_on_errors() -> None:
    model, (x, y) = _classifier()
    model.train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    outputs = model(x)

    def check() -> None:
        assert model.training and model[2].training
        assert not model[0].weight.requires_grad and model[0].bias.requires_grad
        assert torch.equal(model[2].weight.grad, torch.ones(3, 8)) and model[0].bias.grad is None
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert not any(m._forward_hooks or m._backward_hooks or m._forward_pre_hooks for m in model.modules())
        assert torch.equal(model(x), outputs)

    InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=6, projection_dim=3).fit((x, y)).scores((x, y), (x, y))
    check()
    calls = []

    def fails_later(out: torch.Tensor, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(1)
        return CE(out, batch[1]) * (float("nan") if len(calls) > 3 else 1.0)

    with pytest.raises(ValueError, match="not finite"):
        InfluenceFunction(model, fails_later, method="arnoldi", arnoldi_dim=6, projection_dim=3).fit((x, y))
    check()


def test_the_hessian_is_taken_in_eval_mode() -> None:
    """Dropout in a model left in train mode: the products run in eval mode, so two fits give the same eigenpairs."""
    model, (x, y) = _classifier()
    model = nn.Sequential(model[0], nn.Dropout(0.5), *model[1:]).train()
    first, again = (
        InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=10, projection_dim=4).fit((x, y)) for _ in range(2)
    )
    assert torch.equal(first.state["eigenvalues"], again.state["eigenvalues"]) and model.training


def test_bad_settings_and_sources_get_clear_errors() -> None:
    model, (x, y) = _classifier()
    with pytest.raises(ValueError, match=r"`projection_dim` \(60\) must be at most `arnoldi_dim` \(50\)"):
        InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=50, projection_dim=60)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="`arnoldi_dim` must be a positive integer"):
            InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`projection_dim` must be a positive integer"):
        InfluenceFunction(model, CE, method="arnoldi", projection_dim=0)
    once = iter([(x[:20], y[:20]), (x[20:], y[20:])])  # a generator: empty on the second pass
    with pytest.raises(ValueError, match="must be iterable again"):
        InfluenceFunction(model, CE, method="arnoldi", arnoldi_dim=4, projection_dim=2).fit(once)
    untrained, data = _untrained()
    with pytest.raises(ValueError, match=r"not positive definite.*lower `projection_dim`"):
        InfluenceFunction(untrained, CE, method="arnoldi", damping=0.1, projection_dim=31).fit(data)
    with pytest.raises(RuntimeError, match=r"call \.fit"):
        InfluenceFunction(model, CE, method="arnoldi").scores((x, y), (x, y))


@pytest.mark.peers
def test_exact_equals_captum_naive_influence_function(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """captum 0.9's ``NaiveInfluenceFunction`` (the explicit Hessian) against ``method="exact"``, mapped as above.

    captum keeps the ``projection_dim`` largest eigenpairs of the Hessian of the summed loss and adds ``hessian_reg``
    (through a float32 identity: 0.5 is exact); with every eigenpair kept it is the damped inverse, so our
    ``damping`` is ``hessian_reg / n`` and our scores are n times captum's.
    """
    captum = pytest.importorskip("captum.influence._core.influence_function")
    model, (x, y) = _classifier()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    n = len(x)
    parameters = sum(p.numel() for p in model.parameters())
    expected = InfluenceFunction(model, CE, method="exact", damping=0.5 / n).fit((x, y)).scores((x[:6], y[:6]), (x, y))
    reference = captum.NaiveInfluenceFunction(
        model,
        torch.utils.data.TensorDataset(x, y),
        str(path),
        loss_fn=CE,
        batch_size=16,
        projection_dim=parameters,
        hessian_reg=0.5,
        hessian_inverse_tol=-1e30,  # keep every eigenpair (the damped Hessian is positive definite here)
    )
    theirs = reference.influence((x[:6], y[:6])) * n
    torch.testing.assert_close(expected, theirs, rtol=1e-9, atol=1e-9 * float(theirs.abs().max()))
