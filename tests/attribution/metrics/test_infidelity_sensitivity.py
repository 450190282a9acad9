"""Infidelity and max-sensitivity: answers worked out by hand, slow loops over the paper's formulas, batching, state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attribution import IntegratedGradients, Saliency, targets
from attribution.metrics import infidelity, sensitivity_max
from attribution.metrics._explanation import chunk_sizes
from tests.support import hook_state


class Counting(nn.Module):
    """A tanh MLP on flattened inputs that records the rows of every forward."""

    def __init__(self, features: int, classes: int = 3) -> None:
        super().__init__()
        self.hidden = nn.Linear(features, 6)
        self.out = nn.Linear(6, classes)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        return self.out(torch.tanh(self.hidden(x.flatten(1))))


def gaussian(scale: float = 0.1):
    """A local perturbation: ``I ~ N(0, scale^2)``, perturbed input ``x - I`` (the paper's, and captum's example)."""

    def perturb(inputs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        noise = scale * torch.randn(inputs.shape, generator=generator, dtype=inputs.dtype)
        return noise, inputs - noise

    return perturb


def recording(perturb):
    """``perturb`` that also keeps every (inputs, perturbation, perturbed) it was called with and returned."""
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def wrapped(inputs, generator):
        perturbation, perturbed = perturb(inputs, generator)
        seen.append((inputs.clone(), perturbation.clone(), perturbed.clone()))
        return perturbation, perturbed

    return wrapped, seen


@pytest.fixture
def mlp() -> Counting:
    torch.manual_seed(0)
    return Counting(3 * 4 * 6).double().eval()


@pytest.fixture
def images() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 3, 4, 6, dtype=torch.float64)  # non-square


# -- infidelity: known answers -------------------------------------------------------------------------------------
def test_infidelity_of_the_exact_gradient_of_a_linear_model_is_zero(images):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 4)).double().eval()
    classes = [3, 0, 2]
    gradient = Saliency(model, abs=False)(images, classes)
    assert (gradient > 0).any() and (gradient < 0).any()
    scores = infidelity(model, gradient, images, gaussian(0.5), classes, n=7)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, torch.zeros(3, dtype=torch.float64), atol=1e-24, rtol=0)
    wrong = infidelity(model, gradient.roll(1, 0), images, gaussian(0.5), classes, n=7)  # another item's gradient
    assert (wrong > 1e-2).all()


class TwoFeatures(nn.Module):
    """``f(x) = 2 x_0 - x_1``, one output per item."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x[:, 0] - x[:, 1]


def fixed_perturbations(rows: list[list[float]]):
    """Perturbations taken in turn from ``rows``, whatever the chunking; perturbed input ``x - I``."""
    queue = torch.tensor(rows, dtype=torch.float64)
    taken = [0]

    def perturb(inputs, generator):
        noise = queue[taken[0] : taken[0] + len(inputs)]
        taken[0] += len(inputs)
        return noise, inputs - noise

    return perturb


@pytest.mark.parametrize("batch_size", [1, 2, 32])
def test_infidelity_by_hand_on_two_features(batch_size):
    # phi = (1, 1) at x = (3, 4); I = (1, 0): I.phi = 1, f(x) - f(x - I) = 2, error 1; I = (0, 2): I.phi = 2,
    # f(x) - f(x - I) = -2, error 16. Mean 8.5. Normalised: beta = (1*2 + 2*(-2)) / (1 + 4) = -0.4, and the error
    # left, sum d^2 - (sum a d)^2 / sum a^2 = 8 - 4/5 = 7.2, over 2 perturbations: 3.6.
    x, phi = torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    plain = infidelity(TwoFeatures(), phi, x, fixed_perturbations([[1, 0], [0, 2]]), n=2, batch_size=batch_size)
    assert plain.tolist() == [8.5]
    best = infidelity(TwoFeatures(), phi, x, fixed_perturbations([[1, 0], [0, 2]]), n=2, normalize=True)
    assert best.tolist() == [pytest.approx(3.6, rel=1e-14)]


def test_infidelity_of_integrated_gradients_is_its_squared_convergence_delta(images):
    # captum's convention for attributions multiplied by inputs: I = 1 everywhere and the perturbed input is the
    # baseline, so I.phi = sum(phi) and f(x) - f(x_I) = f(x) - f(b): the error is delta^2 for every draw.
    torch.manual_seed(3)
    model = Counting(72).double().eval()
    classes = [1, 2, 0]
    attributions, delta = IntegratedGradients(model, steps=2, method="riemann_left")(images, classes, return_delta=True)
    assert (delta.abs() > 1e-3).all()  # 2 left Riemann nodes: a real quadrature error

    def to_baseline(inputs, generator):
        return torch.ones_like(inputs), torch.zeros_like(inputs)

    scores = infidelity(model, attributions, images, to_baseline, classes, n=3)
    torch.testing.assert_close(scores, delta.square(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("factor", [100.0, -3.0])
def test_normalised_infidelity_does_not_change_when_the_attributions_are_scaled(mlp, images, factor):
    phi = torch.randn_like(images)
    one = infidelity(mlp, phi, images, gaussian(), [0, 1, 2], n=6, normalize=True)
    scaled = infidelity(mlp, factor * phi, images, gaussian(), [0, 1, 2], n=6, normalize=True)
    torch.testing.assert_close(scaled, one, rtol=1e-10, atol=0)
    plain = infidelity(mlp, phi, images, gaussian(), [0, 1, 2], n=6)
    assert not torch.allclose(infidelity(mlp, factor * phi, images, gaussian(), [0, 1, 2], n=6), plain)


# -- infidelity: the formula, slowly -------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True])
def test_infidelity_equals_the_papers_formula_computed_one_perturbation_at_a_time(mlp, images, normalize):
    phi = torch.randn_like(images)
    classes = [2, 0, 1]
    perturb, seen = recording(gaussian(0.3))
    scores = infidelity(mlp, phi, images, perturb, classes, n=5, normalize=normalize, batch_size=6)
    assert [len(inputs) for inputs, _, _ in seen] == [6, 6, 3]  # k = 2, 2, 1 copies of each item
    with torch.no_grad():
        expected = []
        for i in range(3):
            a, d = [], []
            fx = mlp(images[i : i + 1])[0, classes[i]]
            for inputs, perturbation, perturbed in seen:
                k = len(inputs) // 3
                for j in range(k):
                    row = i * k + j  # item-major: copy j of item i
                    assert torch.equal(inputs[row], images[i])
                    a.append((perturbation[row] * phi[i]).sum())
                    d.append(fx - mlp(perturbed[row : row + 1])[0, classes[i]])
            a_, d_ = torch.stack(a), torch.stack(d)
            beta = (a_ * d_).sum() / a_.square().sum() if normalize else 1.0
            expected.append((beta * a_ - d_).square().mean())
    torch.testing.assert_close(scores, torch.stack(expected), rtol=1e-12, atol=1e-15)


def test_infidelity_of_two_inputs_sums_both_dot_products():
    torch.manual_seed(4)
    left, right = nn.Linear(3, 2).double(), nn.Linear(5, 2).double()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = left, right

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.left(a)) * self.right(b)

    model = Two().eval()
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    phi = (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64))

    def perturb(inputs, generator):
        noise = tuple(0.2 * torch.randn(x.shape, generator=generator, dtype=x.dtype) for x in inputs)
        return noise, tuple(x - e for x, e in zip(inputs, noise, strict=True))

    scores = infidelity(model, phi, (a, b), perturb, 1, n=4)
    generator = torch.Generator().manual_seed(0)
    (ea, eb), (pa, pb) = perturb((a.repeat_interleave(4, 0), b.repeat_interleave(4, 0)), generator)
    dots = (ea.view(2, 4, 3) * phi[0][:, None]).sum(2) + (eb.view(2, 4, 5) * phi[1][:, None]).sum(2)
    with torch.no_grad():
        differences = model(a, b)[:, 1, None] - model(pa, pb)[:, 1].view(2, 4)
    torch.testing.assert_close(scores, (dots - differences).square().mean(1), rtol=1e-12, atol=0)


# -- targets and batching ------------------------------------------------------------------------------------------
def test_infidelity_targets_none_int_list_and_callable_agree(mlp, images):
    phi = torch.randn_like(images)
    with torch.no_grad():
        top = mlp(images).argmax(1).tolist()
    by_list = infidelity(mlp, phi, images, gaussian(), top, n=5, batch_size=6)
    assert torch.equal(infidelity(mlp, phi, images, gaussian(), None, n=5, batch_size=6), by_list)
    assert torch.equal(infidelity(mlp, phi, images, gaussian(), targets.ClassLogit(top), n=5, batch_size=6), by_list)
    same = infidelity(mlp, phi, images, gaussian(), 1, n=5, batch_size=6)
    assert torch.equal(same, infidelity(mlp, phi, images, gaussian(), [1, 1, 1], n=5, batch_size=6))


@pytest.mark.parametrize(("batch", "n", "batch_size", "expected"), [(3, 10, 12, [4, 4, 2]), (3, 10, 1, [1] * 10)])
def test_chunks_hold_whole_sets_of_copies(batch, n, batch_size, expected):
    assert chunk_sizes(n, batch, batch_size) == expected
    assert sum(chunk_sizes(n, batch, batch_size)) == n


def test_infidelity_runs_n_perturbations_of_all_items_in_few_forwards(mlp, images):
    phi = torch.randn_like(images)
    infidelity(mlp, phi, images, gaussian(), 0, n=10, batch_size=12)
    assert mlp.calls == [3, 12, 12, 6]  # the inputs, then ceil(10 * 3 / 12) forwards of whole sets of copies
    mlp.calls.clear()
    infidelity(mlp, phi, images, gaussian(), 0, n=10, batch_size=30)
    assert mlp.calls == [3, 30]
    mlp.calls.clear()
    one = infidelity(mlp, phi, images, gaussian(), 0, n=10, batch_size=1)
    assert mlp.calls == [3] + [3] * 10  # at least one copy of each item per forward
    # as in captum, `perturb` is given other batches, so it draws other perturbations: another estimate
    assert not torch.equal(one, infidelity(mlp, phi, images, gaussian(), 0, n=10, batch_size=30))


def test_infidelity_is_a_function_of_the_seed_and_leaves_the_global_random_state(mlp, images):
    phi = torch.randn_like(images)
    state = torch.get_rng_state()
    first = infidelity(mlp, phi, images, gaussian(), 0, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, infidelity(mlp, phi, images, gaussian(), 0, seed=5))
    assert not torch.equal(first, infidelity(mlp, phi, images, gaussian(), 0, seed=6))


def documented_noise(x: torch.Tensor, n: int, radius: float, seed: int) -> torch.Tensor:
    """``(B * n, ...)`` noisy copies, item-major, drawn as sensitivity_max documents: copy by copy, (B, ...) each."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.stack([torch.rand(x.shape, generator=generator, dtype=x.dtype) for _ in range(n)], dim=1)
    return x.repeat_interleave(n, 0) + (2 * u.flatten(0, 1) - 1) * radius


# -- sensitivity: known answers ------------------------------------------------------------------------------------
def test_sensitivity_of_saliency_is_zero_inside_one_linear_region():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()
    x = torch.randn(64, 4, dtype=torch.float64)
    with torch.no_grad():
        pre = model[0](x)
    margin = pre.abs().min(1).values / model[0].weight.abs().sum(1).max()  # no unit can change sign within this
    x = x[margin > 0.05][:4]
    assert len(x) == 4
    scores = sensitivity_max(Saliency(model, abs=False), x, [0, 2, 1, 0], radius=0.04, n=8)
    assert scores.tolist() == [0.0, 0.0, 0.0, 0.0]
    far = sensitivity_max(Saliency(model, abs=False), x, [0, 2, 1, 0], radius=3.0, n=8)
    assert (far > 0).any()  # a radius that crosses ReLU boundaries changes the gradient


@pytest.mark.parametrize("norm", ["fro", 1, math.inf])
def test_sensitivity_equals_the_papers_formula_with_the_documented_noise(images, norm):
    def method(x):  # a function of the inputs alone, nonlinear, both signs
        return x * x.abs() - 0.5 * x

    radius, n, batch = 0.1, 4, len(images)
    scores = sensitivity_max(method, images, radius=radius, n=n, norm=norm, seed=7, batch_size=batch)
    noisy = documented_noise(images, n, radius, seed=7)
    order = 2 if norm == "fro" else norm
    expected = []
    for i in range(batch):
        base = method(images[i]).flatten()
        changes = [torch.linalg.vector_norm(method(noisy[i * n + j]).flatten() - base, ord=order) for j in range(n)]
        expected.append(max(changes) / torch.linalg.vector_norm(base, ord=order))
    torch.testing.assert_close(scores, torch.stack(expected), rtol=1e-12, atol=0)


def test_sensitivity_noise_stays_in_the_linf_ball_and_has_both_signs(images):
    seen = []

    def method(x):
        seen.append(x.clone())
        return x

    sensitivity_max(method, images, radius=0.02, n=10, batch_size=9)
    assert [len(x) for x in seen] == [3, 9, 9, 9, 3]  # the inputs, then k = 3, 3, 3, 1 copies of each item
    moved = torch.cat([(x.view(3, -1, *images.shape[1:]) - images[:, None]).flatten() for x in seen[1:]])
    assert moved.abs().max() <= 0.02
    assert moved.max() > 0.019 and moved.min() < -0.019


def test_sensitivity_of_all_zero_attributions_divides_by_one(images):
    assert sensitivity_max(lambda x: torch.zeros_like(x), images).tolist() == [0.0, 0.0, 0.0]

    def moved(x):  # zero on the inputs, the noise itself on their copies: the relative change is the absolute one
        return x - images.repeat_interleave(len(x) // len(images), 0)

    scores = sensitivity_max(moved, images, radius=0.01, n=3, norm=math.inf)
    assert ((scores > 0.005) & (scores <= 0.01)).all()


def test_sensitivity_targets_expand_for_the_copies(mlp, images):
    method, classes, n = Saliency(mlp, abs=False), [2, 0, 1], 4
    scores = sensitivity_max(method, images, classes, n=n, batch_size=3 * n, seed=3)
    noisy = documented_noise(images, n, 0.02, seed=3)
    expected = []
    for i, c in enumerate(classes):
        base = method(images[i : i + 1], c)
        changes = [(method(noisy[i * n + j : i * n + j + 1], c) - base).norm() for j in range(n)]
        expected.append(max(changes) / base.norm())
    torch.testing.assert_close(scores, torch.stack(expected), rtol=1e-10, atol=0)
    chunked = sensitivity_max(method, images, classes, n=n, batch_size=6, seed=3)  # two chunks of k = 2
    by_callable = sensitivity_max(method, images, targets.ClassLogit(classes), n=n, batch_size=6, seed=3)
    assert torch.equal(by_callable, chunked)
    torch.testing.assert_close(chunked, scores, rtol=1e-12, atol=0)  # the same draws, in other chunks
    assert not torch.equal(scores, sensitivity_max(method, images, [0, 0, 0], n=n, batch_size=3 * n, seed=3))


def test_sensitivity_calls_the_method_in_few_batches(mlp, images):
    sensitivity_max(Saliency(mlp), images, 0, n=10, batch_size=12)
    assert mlp.calls == [3, 12, 12, 6]


# -- the model is left as it was -----------------------------------------------------------------------------------
def test_the_model_is_left_exactly_as_it_was_also_on_error(images):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 8), nn.Dropout(0.5), nn.Linear(8, 3)).double().train()
    model[1].weight.requires_grad_(False)
    model[3].weight.grad = torch.full_like(model[3].weight, 0.5)
    grad, hooks_before = model[3].weight.grad, hook_state(model)
    params = [p.detach().clone() for p in model.parameters()]
    model.eval()
    with torch.no_grad():
        before = model(images)
    model.train()
    phi = torch.randn_like(images)
    in_train_mode = infidelity(model, phi, images, gaussian(), 0, n=4)
    moved = sensitivity_max(Saliency(model), images, 0, n=4)
    model.eval()  # both run in eval mode: dropout off, so the numbers are those of the eval model
    assert torch.equal(in_train_mode, infidelity(model, phi, images, gaussian(), 0, n=4))
    assert torch.equal(moved, sensitivity_max(Saliency(model), images, 0, n=4))
    model.train()

    def broken(inputs, generator):
        raise RuntimeError("perturbation failed")

    with pytest.raises(RuntimeError, match="perturbation failed"):
        infidelity(model, phi, images, broken, 0)
    assert model.training and all(m.training for m in model.modules())
    assert not model[1].weight.requires_grad and model[3].weight.requires_grad
    assert model[3].weight.grad is grad and model[1].weight.grad is None
    assert hook_state(model) == hooks_before and torch.is_grad_enabled()
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(images), before)


# -- bad input -----------------------------------------------------------------------------------------------------
def test_infidelity_errors_say_what_was_expected(mlp, images):
    phi = torch.randn_like(images)
    with pytest.raises(ValueError, match=r"shaped like `inputs` \(3, 3, 4, 6\).*summed over channels"):
        infidelity(mlp, phi.sum(1), images, gaussian())
    with pytest.raises(ValueError, match="NaN"):
        infidelity(mlp, phi.index_fill(0, torch.tensor([1]), float("nan")), images, gaussian())
    with pytest.raises(TypeError, match=r"pair \(perturbation, perturbed_inputs\)"):
        infidelity(mlp, phi, images, lambda x, g: x + 1)
    with pytest.raises(ValueError, match=r"perturbed inputs `perturb` returns must be shaped like the repeated"):
        infidelity(mlp, phi, images, lambda x, g: (x, x[:1]), n=2)
    with pytest.raises(ValueError, match="`n` must be a positive int; got 0"):
        infidelity(mlp, phi, images, gaussian(), n=0)
    with pytest.raises(ValueError, match="`target` has 2 entries but the batch has 3"):
        infidelity(mlp, phi, images, gaussian(), [0, 1])
    with pytest.raises(TypeError, match=r"floating-point.*\.float\(\)"):
        infidelity(mlp, phi, images.long(), gaussian())
    with pytest.raises(TypeError, match="`perturb` must be a function"):
        infidelity(mlp, phi, images, "gaussian")  # type: ignore[arg-type]


def test_sensitivity_errors_say_what_was_expected(mlp, images):
    with pytest.raises(ValueError, match=r"`norm` must be 'fro'.*got 'nuc'"):
        sensitivity_max(Saliency(mlp), images, norm="nuc")
    with pytest.raises(ValueError, match="`radius` must be a number >= 0"):
        sensitivity_max(Saliency(mlp), images, radius=-1.0)
    with pytest.raises(ValueError, match=r"one row per input row \(3\)"):
        sensitivity_max(lambda x: x[:1], images)
    with pytest.raises(ValueError, match="same shape per item"):
        sensitivity_max(lambda x: x if len(x) == 3 else x[:, :1], images)
    with pytest.raises(TypeError, match=r"must take \(inputs, target\) to explain `target`"):
        sensitivity_max(lambda x: x, images, target=1)
    with pytest.raises(TypeError, match="attribution callable"):
        sensitivity_max(None, images)  # type: ignore[arg-type]


def test_sensitivity_warns_about_nan_attributions(images):
    images = images.clone()
    images[1, 0, 2, 3] = float("nan")
    with pytest.warns(UserWarning, match=r"item\(s\) \[1\] hold NaN"):
        scores = sensitivity_max(lambda x: x, images)
    assert scores.isnan().tolist() == [False, True, False]
