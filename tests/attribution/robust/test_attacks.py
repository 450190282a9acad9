"""FGSM and PGD: captum's hand-worked answers, slow re-implementations in float64, the balls, the model's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import targets
from attribution.robust import fgsm, pgd
from tests.support import hook_state


class Basic(nn.Module):
    """captum's ``BasicModel``: ``1 - relu(1 - x)``, one output per input value (its default loss is ``-log``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1 - torch.relu(1 - x)


class Basic2(nn.Module):
    """captum's ``BasicModel2``: ``relu(relu(a) - 1 - relu(b))``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(a) - 1 - torch.relu(b))


class Softmax(nn.Module):
    """A tanh MLP ending in a softmax (probabilities, for the default loss), counting its forwards."""

    def __init__(self, features: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(features, 7), nn.Linear(7, classes)
        self.calls = 0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.logits(x).softmax(dim=1)


@pytest.fixture
def net() -> Softmax:
    torch.manual_seed(0)
    return Softmax().double().eval()


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 5, dtype=torch.float64)


# -- captum's answers, worked out by hand --------------------------------------------------------------------------
def test_fgsm_on_captums_example():
    # -log(out[1]) with out[1] = 1 - relu(1 - x_1) = x_1 = -9: d/dx_1 = -1/x_1 > 0, so x_1 rises by epsilon
    x = torch.tensor([[2.0, -9.0, 9.0, 1.0, -3.0]])
    assert fgsm(Basic(), x, 1, epsilon=0.1).tolist() == [[2.0, pytest.approx(-8.9), 9.0, 1.0, -3.0]]
    y = torch.tensor([[9.0, 10.0, -6.0, -1.0]])
    targeted = fgsm(Basic(), y, 3, epsilon=0.2, targeted=True)
    torch.testing.assert_close(targeted, torch.tensor([[9.0, 10.0, -6.0, -1.2]]))
    bounded = fgsm(Basic(), y, 3, epsilon=0.2, targeted=True, lower_bound=-5.0, upper_bound=5.0)
    torch.testing.assert_close(bounded, torch.tensor([[5.0, 5.0, -5.0, -1.2]]))
    masked = fgsm(Basic(), x, 1, epsilon=0.1, mask=torch.tensor([[1, 0, 0, 1, 1]]))
    assert torch.equal(masked, x)


def test_fgsm_of_two_inputs_with_a_class_per_item():
    a, b = torch.tensor([[4.0, -1.0], [3.0, 10.0]]), torch.tensor([[2.0, -5.0], [-2.0, 1.0]])
    moved_a, moved_b = fgsm(Basic2(), (a, b), [0, 1], epsilon=0.1)
    torch.testing.assert_close(moved_a, torch.tensor([[3.9, -1.0], [3.0, 9.9]]))
    torch.testing.assert_close(moved_b, torch.tensor([[2.1, -5.0], [-2.0, 1.1]]))
    towards_a, towards_b = fgsm(Basic2(), (a, b), torch.tensor([0, 1]), epsilon=0.1, targeted=True)
    torch.testing.assert_close(towards_a, torch.tensor([[4.1, -1.0], [3.0, 10.1]]))
    torch.testing.assert_close(towards_b, torch.tensor([[1.9, -5.0], [-2.0, 0.9]]))


def test_pgd_on_captums_examples():
    x = torch.tensor([[2.0, -9.0, 9.0, 1.0, -3.0]])
    torch.testing.assert_close(
        pgd(Basic(), x, 4, epsilon=0.25, step_size=0.1, steps=2), torch.tensor([[2.0, -9.0, 9.0, 1.0, -2.8]])
    )
    y = torch.tensor([[9.0, 10.0, -6.0, -1.0]])
    torch.testing.assert_close(  # three steps of 0.1 towards class 3, clipped to the ball of 0.2
        pgd(Basic(), y, 3, epsilon=0.2, step_size=0.1, steps=3, targeted=True), torch.tensor([[9.0, 10.0, -6.0, -1.2]])
    )
    l2 = pgd(Basic(), y, 2, epsilon=0.2, step_size=0.1, steps=3, targeted=True, norm="L2")
    torch.testing.assert_close(l2, torch.tensor([[9.0, 10.0, -6.2, -1.0]]), atol=1e-6, rtol=0)  # renorm's 1e-7
    a, b = torch.tensor([[4.0, -1.0], [3.0, 10.0]]), torch.tensor([[2.0, -5.0], [-2.0, 1.0]])
    moved_a, moved_b = pgd(Basic2(), (a, b), 0, epsilon=0.25, step_size=0.1, steps=3, norm="L2")
    torch.testing.assert_close(moved_a, torch.tensor([[3.75, -1.0], [2.75, 10.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(moved_b, torch.tensor([[2.25, -5.0], [-2.0, 1.0]]), atol=1e-6, rtol=0)


# -- slow re-implementations ---------------------------------------------------------------------------------------
def slow_gradient(net: Softmax, x: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """d(-log p_class)/dx, item by item, through the logits' log-softmax (not the library's path)."""
    rows = []
    for i, c in enumerate(classes):
        xi = x[i : i + 1].clone().requires_grad_(True)
        (-torch.log_softmax(net.logits(xi), dim=1)[0, c]).backward()
        rows.append(xi.grad[0])
    return torch.stack(rows)


@pytest.mark.parametrize("targeted", [False, True])
def test_fgsm_equals_the_formula(net, x, targeted):
    classes = [2, 0, 1, 2]
    grad = slow_gradient(net, x, classes)
    expected = x + (-1 if targeted else 1) * 0.05 * grad.sign()
    torch.testing.assert_close(fgsm(net, x, classes, epsilon=0.05, targeted=targeted), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("norm", ["Linf", "L2"])
def test_pgd_equals_the_formula_and_stays_in_its_ball(net, x, norm):
    classes, epsilon = [1, 1, 0, 2], 0.25
    x = x.clamp(-1.4, 1.4)  # inside the bounds, so that the clamp to them cannot leave the ball
    current = x.clone()
    for _ in range(6):
        stepped = current + 0.1 * slow_gradient(net, current, classes).sign()
        change = stepped - x
        if norm == "Linf":
            change = change.clamp(-epsilon, epsilon)
        else:
            length = change.norm(dim=1, keepdim=True)
            change = torch.where(length > epsilon, change * epsilon / (length + 1e-7), change)
        current = (x + change).clamp(-1.5, 1.5)
    moved = pgd(net, x, classes, epsilon=epsilon, step_size=0.1, steps=6, norm=norm, lower_bound=-1.5, upper_bound=1.5)
    torch.testing.assert_close(moved, current, rtol=0, atol=1e-14)
    change = moved - x
    size = change.abs().amax(1) if norm == "Linf" else change.norm(dim=1)
    assert (size <= epsilon + 1e-12).all() and (size > 0.1).all()
    assert moved.min() >= -1.5 and moved.max() <= 1.5


@pytest.mark.parametrize("norm", ["Linf", "L2"])
def test_pgd_random_start_is_in_the_ball_of_each_item(net, x, norm):
    start = pgd(net, x, 0, epsilon=0.3, step_size=0.1, steps=0, norm=norm, random_start=True, seed=2)
    size = (start - x).abs().amax(1) if norm == "Linf" else (start - x).norm(dim=1)
    assert (size <= 0.3).all() and (size > 0).all()
    assert size.unique().numel() == 4  # each item its own radius (captum's L2 start breaks for several items)
    again = pgd(net, x, 0, epsilon=0.3, step_size=0.1, steps=0, norm=norm, random_start=True, seed=2)
    assert torch.equal(start, again)
    state = torch.get_rng_state()
    pgd(net, x, 0, epsilon=0.3, step_size=0.1, steps=0, norm=norm, random_start=True, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_default_loss_on_probabilities_is_cross_entropy_on_logits(net, x):
    class Logits(nn.Module):
        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return net.logits(inputs)

    cross_entropy = nn.CrossEntropyLoss(reduction="none")
    for attack in (
        lambda model, **kw: fgsm(model, x, [0, 1, 2, 0], epsilon=0.1, **kw),
        lambda model, **kw: pgd(model, x, [0, 1, 2, 0], epsilon=0.2, step_size=0.05, steps=4, norm="L2", **kw),
    ):
        torch.testing.assert_close(attack(Logits(), loss=cross_entropy), attack(net), rtol=0, atol=1e-14)


def test_targets_none_and_callable(net, x):
    with torch.no_grad():
        top = net(x).argmax(1).tolist()
    by_class = pgd(net, x, top, epsilon=0.2, step_size=0.05, steps=3)
    net.calls = 0
    assert torch.equal(pgd(net, x, None, epsilon=0.2, step_size=0.05, steps=3), by_class)
    assert net.calls == 4  # the top classes once, then one forward per step for all items
    assert torch.equal(pgd(net, x, targets.ClassLogit(top), epsilon=0.2, step_size=0.05, steps=3), by_class)


def test_untargeted_raises_the_loss_and_targeted_lowers_it(net, x):
    def loss(inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return -net(inputs)[:, 1].log()

    assert (loss(fgsm(net, x, 1, epsilon=0.01)) > loss(x)).all()
    assert (loss(pgd(net, x, 1, epsilon=0.05, step_size=0.01, steps=5, targeted=True)) < loss(x)).all()


# -- the model and the inputs are left as they were ----------------------------------------------------------------
def test_the_model_and_the_inputs_are_left_as_they_were(x):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5), nn.Linear(6, 3), nn.Softmax(dim=1)).double().train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    grad, hooks, kept = model[2].weight.grad, hook_state(model), x.clone()
    moved = pgd(model, x, 0, epsilon=0.2, step_size=0.1, steps=2)
    model.eval()
    assert torch.equal(moved, pgd(model, x, 0, epsilon=0.2, step_size=0.1, steps=2))  # eval mode: dropout off
    model.train()
    with pytest.raises(ValueError, match="`loss` must return"):
        fgsm(model, x, 0, epsilon=0.1, loss=lambda out, t: out)
    assert model.training and model[1].training and hook_state(model) == hooks
    assert not model[0].weight.requires_grad and model[0].weight.grad is None and model[2].weight.grad is grad
    assert model[0].bias.grad is None and torch.is_grad_enabled()
    assert torch.equal(x, kept) and not moved.requires_grad


def test_errors_say_what_was_expected(net, x):
    with pytest.raises(ValueError, match="`norm` must be 'Linf' or 'L2'"):
        pgd(net, x, epsilon=0.1, step_size=0.1, steps=1, norm="linf")
    with pytest.raises(ValueError, match=r"`steps` must be an int >= 0; got 1\.5"):
        pgd(net, x, epsilon=0.1, step_size=0.1, steps=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`epsilon` must be a number >= 0"):
        fgsm(net, x, epsilon=-0.1)
    with pytest.raises(ValueError, match=r"`mask` of shape \(3,\) does not broadcast to the inputs \(4, 5\)"):
        fgsm(net, x, epsilon=0.1, mask=torch.ones(3))
    with pytest.raises(ValueError, match="`target` has 2 entries but the batch has 4"):
        fgsm(net, x, [0, 1], epsilon=0.1)
    with pytest.raises(TypeError, match="floating-point"):
        fgsm(net, x.long(), epsilon=0.1)
