"""Attribution patching against a slow float64 re-implementation of its formula, one cell at a time.

Each test is built so that one likely one-line slip changes its numbers: the sign of the normalising denominator
(both directions, effects of both signs), the direction and end points of the integrated-gradients line (a model
whose gradient is not constant along the line), the copy that keeps an in-place operation after the site away from
the leaf being differentiated, and the order of the cell axes (3 positions against 2 heads).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import activation_patching, attribution_patching


class Cubic(nn.Module):
    """Elementwise ``x + 0.5 x^2 - 0.3 x^3``: its gradient changes along any line, differently in each direction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * x**2 - 0.3 * x**3


class ScaleInPlace(nn.Module):
    """``x * 1.5 + 0.2`` written in place on its input, as an in-place activation right after a site would be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1.5).add_(0.2)


class Net(nn.Module):
    """``up -> scale (in place) -> act (cubic) -> down`` on ``(batch, positions, 3)``: each position on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(3, 4)
        self.scale = ScaleInPlace()
        self.act = Cubic()
        self.down = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.scale(self.up(x))))


WEIGHTS = torch.tensor([[0.7, -1.3, 0.4], [-0.2, 0.9, 1.6]], dtype=torch.float64)  # (batch, positions), asymmetric


def metric(out: torch.Tensor) -> torch.Tensor:
    """A weighted sum over batch and positions of output 0, minus output 1: depends on every cell differently."""
    return (WEIGHTS * (out[..., 0] - 0.5 * out[..., 1])).sum()


@pytest.fixture
def setup():
    torch.manual_seed(1)  # a seed whose cells have both signs in both directions
    model = Net().double().eval()
    clean = torch.randn(2, 3, 3, dtype=torch.float64)
    corrupted = torch.randn(2, 3, 3, dtype=torch.float64)
    return model, clean, corrupted


def suffix(model: Net, name: str):
    """The rest of the model after the output of ``name``, as a function of that activation."""
    if name == "up":
        return lambda a: model.down(model.act(model.scale(a.clone())))
    if name == "act":
        return model.down
    raise AssertionError(name)


def activation(model: Net, name: str, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        a = model.up(x)
        return a if name == "up" else model.act(model.scale(a.clone()))


def slow_atp(model, source_x, target_x, name, steps):
    """``metric(target) + sum_cell (a_s - a_t) * mean_j grad(a_t + j/k (a_s - a_t))``, per position, in float64."""
    a_s, a_t = activation(model, name, source_x), activation(model, name, target_x)
    rest = suffix(model, name)
    mean_grad = torch.zeros_like(a_t)
    for j in range(steps):
        point = (a_t + j / steps * (a_s - a_t)).requires_grad_(True)
        (grad,) = torch.autograd.grad(metric(rest(point)), point)
        mean_grad += grad / steps
    with torch.no_grad():
        base = metric(rest(a_t))
    effect = ((a_s - a_t) * mean_grad).sum(dim=(0, 2))  # (positions,)
    return base, metric(rest(a_s)).detach(), effect


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("steps", [1, 3])
def test_each_cell_is_the_slow_formula(setup, direction, steps):
    model, clean, corrupted = setup
    source_x, target_x = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    got = attribution_patching(
        model, clean, corrupted, ["up", "act"], metric, direction=direction, ig_steps=steps, progress=False
    )
    for row, name in enumerate(["up", "act"]):
        base, _, effect = slow_atp(model, source_x, target_x, name, steps)
        torch.testing.assert_close(got[row].double(), (base + effect).float().double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_normalised_cells_divide_by_source_minus_target(setup, direction):
    """0 is the run being patched, 1 the run the activations come from: the denominator is ``m_source - m_target``.

    The cells have both signs, and the denominator is checked to be far from 0 so that its sign matters.
    """
    model, clean, corrupted = setup
    source_x, target_x = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    got = attribution_patching(
        model, clean, corrupted, ["up"], metric, direction=direction, normalize=True, ig_steps=2, progress=False
    )
    base, top, effect = slow_atp(model, source_x, target_x, "up", 2)
    assert abs(float(top - base)) > 0.1
    assert (effect > 0).any() and (effect < 0).any()
    torch.testing.assert_close(got[0].double(), (effect / (top - base)).float().double(), rtol=1e-5, atol=1e-6)


def test_in_place_operation_after_the_site_along_the_line(setup):
    """The line points are leaves; an in-place operation right after the site must work on a copy of them."""
    model, clean, corrupted = setup
    got = attribution_patching(model, clean, corrupted, "up", metric, positions=False, ig_steps=4, progress=False)
    base, _, effect = slow_atp(model, clean, corrupted, "up", 4)
    torch.testing.assert_close(got.double(), (base + effect.sum()).float().double()[None], rtol=1e-5, atol=1e-5)


def test_integrated_gradients_tend_to_exact_patching_without_cells(setup):
    """With all positions at once the IG estimate converges to the exact patching result (the whole line)."""
    model, clean, corrupted = setup
    exact = activation_patching(model, clean, corrupted, "up", metric, positions=False, progress=False)
    far = attribution_patching(model, clean, corrupted, "up", metric, positions=False, ig_steps=1, progress=False)
    near = attribution_patching(model, clean, corrupted, "up", metric, positions=False, ig_steps=64, progress=False)
    assert (near - exact).abs().item() < 0.1 * (far - exact).abs().item()


class Residual(nn.Module):
    """``h = tanh(up(x)); h += mix(norm(h))``: the input of ``norm`` is changed in place after ``norm`` read it."""

    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.view = view  # h = up(x) itself: a Linear on (batch, positions, features) returns a view
        self.up = nn.Linear(3, 4)
        self.norm = Cubic()
        self.mix = nn.Linear(4, 4)
        self.down = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x) if self.view else torch.tanh(self.up(x))
        h += self.mix(self.norm(h))
        return self.down(torch.tanh(h))


def test_input_site_recorded_before_a_later_in_place_change():
    """The activation kept for the product is the site as it was read, not the residual stream after ``h +=``.

    The reference: the gradient of the metric with respect to the input of ``norm`` only (the residual branch
    that skips ``norm`` holds it fixed), times ``a_clean - a_corrupted`` taken before the in-place addition.
    """
    torch.manual_seed(5)
    model = Residual().double().eval()
    clean, corrupted = torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    got = attribution_patching(model, clean, corrupted, "norm", metric, site="input", progress=False)
    with torch.no_grad():
        a_s, a_t = torch.tanh(model.up(clean)), torch.tanh(model.up(corrupted))
    leaf = a_t.clone().requires_grad_(True)
    value = metric(model.down(torch.tanh(a_t + model.mix(model.norm(leaf)))))
    (grad,) = torch.autograd.grad(value, leaf)
    expected = value.detach() + ((a_s - a_t) * grad).sum(dim=(0, 2))
    torch.testing.assert_close(got[0].double(), expected.float().double(), rtol=1e-5, atol=1e-5)


def test_positions_and_heads_keep_their_axes_and_chosen_order(setup):
    """Cells ``(positions, heads, batch)`` for chosen positions in the order given (negative ones from the end)."""
    model, clean, corrupted = setup

    def per_item(out: torch.Tensor) -> torch.Tensor:
        return (WEIGHTS * (out[..., 0] - 0.5 * out[..., 1])).sum(1)

    got = attribution_patching(
        model, clean, corrupted, "act", per_item, positions=[2, 0, -2], heads=2, per_example=True, progress=False
    )
    a_s, a_t = activation(model, "act", clean), activation(model, "act", corrupted)
    point = a_t.clone().requires_grad_(True)
    value = per_item(model.down(point))
    (grad,) = torch.autograd.grad(value.sum(), point)
    product = ((a_s - a_t) * grad).view(2, 3, 2, 2)  # (batch, positions, heads, per head)
    cells = product.sum(-1).permute(1, 2, 0)[[2, 0, 1]]  # (chosen positions, heads, batch)
    assert got.shape == (1, 3, 2, 2)
    torch.testing.assert_close(got[0].double(), (value.detach() + cells).float().double(), rtol=1e-5, atol=1e-5)


class ViewResidual(nn.Module):
    """``h = up(x)`` seen through a transpose (a view made before the site), then ``h += mix(norm(x))`` transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.mix, self.down = nn.Linear(3, 4), Cubic(), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).transpose(0, 1)
        h += self.mix(self.norm(x)).transpose(0, 1)
        return self.down(torch.tanh(h.transpose(0, 1)))


@pytest.mark.parametrize("site", ["input", "output"])
def test_in_place_residual_update_of_a_view_made_before_the_first_site(site):
    torch.manual_seed(5)
    model = ViewResidual().double().eval()
    clean, corrupted = torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    metric(model(clean)).backward()  # the model itself runs and differentiates
    model.zero_grad(set_to_none=True)
    got = attribution_patching(model, clean, corrupted, "norm", metric, site=site, progress=False)
    assert got.shape == (1, 3)


class Twice(nn.Module):
    """``a0 = shared(x)``, ``a1 = shared(tanh(a0))``, output ``down(cubic(a1) + a0)``: one module, two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.act = Cubic()
        self.down = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a0 = self.shared(x)
        return self.down(self.act(self.shared(torch.tanh(a0))) + a0)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_module_called_twice_gets_each_calls_gradient_with_the_other_call_held(steps):
    """Patching a module patches all its calls, so each call's gradient holds the other call's value fixed: here
    the first call's gradient is its direct path only; both calls move along their lines together."""
    torch.manual_seed(7)
    model = Twice().double().eval()
    clean, corrupted = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    got = attribution_patching(model, clean, corrupted, "shared", metric, ig_steps=steps, progress=False)
    with torch.no_grad():
        s0, t0 = model.shared(clean), model.shared(corrupted)
        s1, t1 = model.shared(torch.tanh(s0)), model.shared(torch.tanh(t0))
    mean0, mean1 = torch.zeros_like(t0), torch.zeros_like(t1)
    for j in range(steps):
        p0 = (t0 + j / steps * (s0 - t0)).requires_grad_(True)
        p1 = (t1 + j / steps * (s1 - t1)).requires_grad_(True)
        g0, g1 = torch.autograd.grad(metric(model.down(model.act(p1) + p0)), [p0, p1])
        mean0, mean1 = mean0 + g0 / steps, mean1 + g1 / steps
    with torch.no_grad():
        base = metric(model(corrupted))
    effect = ((s0 - t0) * mean0 + (s1 - t1) * mean1).sum(dim=(0, 2))
    torch.testing.assert_close(got[0].double(), (base + effect).float().double(), rtol=1e-5, atol=1e-5)
