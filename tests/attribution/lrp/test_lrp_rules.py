"""LRP rules against their formulas written out element by element, and LRP's contract (state, errors, targets)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from attribution.lrp import (
    LRP,
    AlphaBeta,
    Composite,
    Epsilon,
    EpsilonPlusFlat,
    Flat,
    Gamma,
    Pass,
    Rule,
    WSquare,
    ZBox,
    ZPlus,
)
from attribution.lrp.rules import stabilize

EPS = 1e-6
LOW, HIGH = -2.0, 2.5


# -- the formulas, one relevance value at a time ------------------------------------------------------------------
def _stab(z: float) -> float:
    return z + EPS * (1.0 if z >= 0 else -1.0)


def _reference(rule: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``R_in[n, i]`` of a linear layer ``z_j = sum_i w[j, i] x_i + b_j`` under ``rule``, by explicit sums."""
    batch, n_in = x.shape
    n_out = w.shape[0]
    out = torch.zeros_like(x)
    p, q = (lambda v: max(v, 0.0)), (lambda v: min(v, 0.0))
    for n, j in itertools.product(range(batch), range(n_out)):
        xs, ws, bj, rj = x[n].tolist(), w[j].tolist(), float(b[j]), float(r[n, j])
        if rule == "epsilon":
            den = _stab(sum(xi * wi for xi, wi in zip(xs, ws, strict=True)) + bj)
            contrib = [xi * wi / den for xi, wi in zip(xs, ws, strict=True)]
        elif rule == "zplus":
            den = _stab(sum(p(xi) * p(wi) + q(xi) * q(wi) for xi, wi in zip(xs, ws, strict=True)) + p(bj))
            contrib = [(p(xi) * p(wi) + q(xi) * q(wi)) / den for xi, wi in zip(xs, ws, strict=True)]
        elif rule == "alpha2beta1":
            den_p = _stab(sum(p(xi) * p(wi) + q(xi) * q(wi) for xi, wi in zip(xs, ws, strict=True)) + p(bj))
            den_n = _stab(sum(p(xi) * q(wi) + q(xi) * p(wi) for xi, wi in zip(xs, ws, strict=True)) + q(bj))
            contrib = [
                2 * (p(xi) * p(wi) + q(xi) * q(wi)) / den_p - 1 * (p(xi) * q(wi) + q(xi) * p(wi)) / den_n
                for xi, wi in zip(xs, ws, strict=True)
            ]
        elif rule == "gamma":  # gamma = 0.25: w + g w+ for the "same sign" pairs, w + g w- for the others
            up, down = (lambda v: v + 0.25 * p(v)), (lambda v: v + 0.25 * q(v))
            z = sum(xi * wi for xi, wi in zip(xs, ws, strict=True)) + bj
            if z > 0:
                den = _stab(sum(p(xi) * up(wi) + q(xi) * down(wi) for xi, wi in zip(xs, ws, strict=True)) + up(bj))
                contrib = [(p(xi) * up(wi) + q(xi) * down(wi)) / den for xi, wi in zip(xs, ws, strict=True)]
            elif z < 0:
                den = _stab(sum(p(xi) * down(wi) + q(xi) * up(wi) for xi, wi in zip(xs, ws, strict=True)) + down(bj))
                contrib = [(p(xi) * down(wi) + q(xi) * up(wi)) / den for xi, wi in zip(xs, ws, strict=True)]
            else:
                contrib = [0.0] * n_in
        elif rule == "zbox":
            terms = [xi * wi - LOW * p(wi) - HIGH * q(wi) for xi, wi in zip(xs, ws, strict=True)]
            den = _stab(sum(terms) + bj - p(bj) - q(bj))
            contrib = [t / den for t in terms]
        elif rule == "wsquare":
            den = _stab(sum(wi * wi for wi in ws) + bj * bj)
            contrib = [wi * wi / den for wi in ws]
        elif rule == "flat":
            contrib = [1.0 / _stab(float(n_in))] * n_in
        else:
            raise AssertionError(rule)
        for i in range(n_in):
            out[n, i] += contrib[i] * rj
    return out


RULES = {
    "epsilon": Epsilon(EPS),
    "zplus": ZPlus(EPS),
    "alpha2beta1": AlphaBeta(2, 1, EPS),
    "gamma": Gamma(0.25, EPS),
    "zbox": ZBox(LOW, HIGH, EPS),
    "wsquare": WSquare(EPS),
    "flat": Flat(EPS),
}


@pytest.fixture
def two_layers() -> nn.Sequential:
    """Linear(4 -> 5), ReLU, Linear(5 -> 3): non-square, biases of both signs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double().eval()
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([0.3, -0.2, 0.5, -0.4, 0.1]))
        model[2].bias.copy_(torch.tensor([-0.3, 0.2, 0.4]))
    return model


@pytest.mark.parametrize("first", list(RULES))
@pytest.mark.parametrize("upper", ["epsilon", "zplus", "alpha2beta1", "gamma"])
def test_rules_match_their_formulas(two_layers: nn.Sequential, first: str, upper: str) -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-0.7, 0.2, -1.5, 0.9]], dtype=torch.float64)
    target = [2, 0]
    composite = Composite([(nn.Linear, RULES[upper])], first_map=[(nn.Linear, RULES[first])])
    got = LRP(two_layers, composite)(x, target=target)

    first_layer, last_layer = two_layers[0], two_layers[2]
    hidden = torch.relu(first_layer(x)).detach()
    out = last_layer(hidden).detach()
    r_out = torch.zeros_like(out)
    r_out[[0, 1], target] = out[[0, 1], target]
    r_hidden = _reference(upper, hidden, last_layer.weight.detach(), last_layer.bias.detach(), r_out)
    expected = _reference(first, x, first_layer.weight.detach(), first_layer.bias.detach(), r_hidden)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("upper", ["alpha2beta1", "gamma"])
def test_an_output_with_no_negative_part_matches_the_formula(two_layers: nn.Sequential, upper: str) -> None:
    """After a dead hidden layer, ``z- = 0`` exactly: its stabiliser's sign (+ in the formula) must not matter."""
    with torch.no_grad():
        two_layers[0].bias.copy_(-torch.tensor([0.3, 0.2, 0.5, 0.4, 0.1]))  # all hidden units off for the 2nd item
        two_layers[2].bias.copy_(torch.tensor([0.3, 0.0, 0.4]))  # b- = 0
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    target = [2, 0]
    composite = Composite([(nn.Linear, RULES[upper])], first_map=[(nn.Linear, RULES["epsilon"])])
    got = LRP(two_layers, composite)(x, target=target)

    first_layer, last_layer = two_layers[0], two_layers[2]
    hidden = torch.relu(first_layer(x)).detach()
    assert hidden[1].abs().max() == 0 and hidden[0].abs().max() > 0
    out = last_layer(hidden).detach()
    r_out = torch.zeros_like(out)
    r_out[[0, 1], target] = out[[0, 1], target]
    r_hidden = _reference(upper, hidden, last_layer.weight.detach(), last_layer.bias.detach(), r_out)
    expected = _reference("epsilon", x, first_layer.weight.detach(), first_layer.bias.detach(), r_hidden)
    assert expected[0].abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_stabilize_moves_away_from_zero_with_sign_one_at_zero() -> None:
    z = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    assert stabilize(z, 0.5).tolist() == [-1.5, 0.5, 2.5]


def test_alpha_beta_rejects_parameters_that_do_not_differ_by_one() -> None:
    with pytest.raises(ValueError, match="alpha - beta = 1"):
        AlphaBeta(2.0, 2.0)


# -- conservation and targets -------------------------------------------------------------------------------------
def _bias_free(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    return model


def test_relevance_is_conserved_without_biases() -> None:
    torch.manual_seed(1)
    model = _bias_free(
        nn.Sequential(
            nn.Conv2d(3, 6, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(6, 4, (3, 2), dilation=(1, 2), groups=2),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * 1 * 2, 3),
        )
    ).double()
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64)
    logits = model(x)
    for composite in (
        Composite([(nn.Linear, Epsilon(0.0)), (nn.Conv2d, ZPlus(0.0))], stabilizer=0.0),
        EpsilonPlusFlat(0.0, 0.0),
    ):
        relevance = LRP(model, composite)(x, target=[0, 2])
        torch.testing.assert_close(relevance.sum((1, 2, 3)), logits[[0, 1], [0, 2]], rtol=1e-10, atol=0.0)


def two_neurons() -> nn.Sequential:
    """``x -> W2 relu(W1 x)``, no biases; at x = (2, 1) the hidden pre-activations are 4 and -5."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0], [-3.0, 1.0]]))
        model[2].weight.copy_(torch.tensor([[3.0, -1.0]]))
    return model


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # top: R_h = 12 * (9, 1) / 10 = (10.8, 1.2); bottom: 10.8 * (1, 4) / 5 + 1.2 * (9, 1) / 10
        (WSquare(0.0), [3.24, 8.76]),
        # top: R_h = 12 / 2 each; bottom: each hidden unit spreads its 6 evenly over the two inputs
        (Flat(0.0), [6.0, 6.0]),
    ],
    ids=["WSquare", "Flat"],
)
def test_a_relu_passes_relevance_of_the_units_it_zeroes(rule: Rule, expected: list[float]) -> None:
    """zennit's Pass on ReLU: under rules that ignore the input, the unit with output 0 keeps its relevance."""
    model = two_neurons()
    x = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    relevance = LRP(model, Composite([(nn.Linear, rule)], stabilizer=0.0))(x, target=0)
    torch.testing.assert_close(relevance, torch.tensor([expected], dtype=torch.float64), rtol=1e-14, atol=0.0)
    assert float(model(x).detach()) == 12.0
    assert float(relevance.sum()) == pytest.approx(12.0, rel=1e-14)  # all of the logit is conserved


def test_a_callable_target_seeds_its_gradient_times_the_logits(two_layers: nn.Sequential) -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    lrp = LRP(two_layers, Composite([(nn.Linear, Epsilon(0.0))]))
    difference = lrp(x, target=lambda logits: logits[:, 1] - logits[:, 0])
    torch.testing.assert_close(difference, lrp(x, target=1) - lrp(x, target=0), rtol=1e-12, atol=1e-14)


def test_target_none_is_the_top_class(two_layers: nn.Sequential) -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    top = two_layers(x).argmax(1)
    lrp = LRP(two_layers)
    torch.testing.assert_close(lrp(x), lrp(x, target=top.tolist()), rtol=0, atol=0)


# -- the layer implementations -----------------------------------------------------------------------------------
class _OwnForwardConv(nn.Conv2d):
    """A conv subclass with its own forward (as timm's Conv2dSame): LRP must call it rather than F.conv2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(
            nn.functional.pad(x, (1, 0, 1, 0)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups
        )


@pytest.mark.parametrize("rule", ["epsilon", "zplus", "alpha2beta1", "gamma", "zbox", "wsquare", "flat"])
def test_a_conv_with_its_own_forward_gets_the_same_rule(rule: str) -> None:
    torch.manual_seed(2)
    own = _OwnForwardConv(3, 4, 2, stride=2).double()
    plain = nn.Conv2d(3, 4, 2, stride=2).double()
    plain.load_state_dict(own.state_dict())
    head = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 5, 3)).double()
    x = torch.randn(2, 3, 7, 10, dtype=torch.float64)
    composite = Composite([(nn.Linear, Epsilon())], first_map=[(nn.Conv2d, RULES[rule])])
    padded = nn.functional.pad(x, (1, 0, 1, 0))
    expected = LRP(nn.Sequential(plain, *head), composite)(padded, target=1)[:, :, 1:, 1:]
    got = LRP(nn.Sequential(own, *head), composite)(x, target=1)
    if rule not in ("zbox", "wsquare", "flat"):  # those give relevance (or bounds) to the padding's zeros too
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert got.shape == x.shape and bool(torch.isfinite(got).all())


class _CalledByKeyword(nn.Module):
    """Conv, batch norm (merged), in-place ReLU, average pool and linear layers, called positionally or by keyword."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(3 * 2 * 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = (self.conv, self.bn, self.act, self.pool)
        for layer in layers:
            x = layer(input=x) if self.keyword else layer(x)
        x = x.flatten(1)
        return self.fc(input=x) if self.keyword else self.fc(x)


def test_modules_called_by_keyword_get_the_same_relevance() -> None:
    """``self.fc(input=x)``: the rules read the input from the keyword (it raised IndexError)."""
    torch.manual_seed(4)
    positional = _CalledByKeyword(keyword=False).double().eval()
    positional.bn.running_var.uniform_(0.5, 2.0)
    by_keyword = _CalledByKeyword(keyword=True).double().eval()
    by_keyword.load_state_dict(positional.state_dict())
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    for composite in (EpsilonPlusFlat(), Composite([(nn.Linear, WSquare()), (nn.Conv2d, ZPlus())])):
        expected = LRP(positional, composite)(x, target=[1, 0])
        got = LRP(by_keyword, composite)(x, target=[1, 0])
        assert bool(expected.abs().sum() > 0)
        assert torch.equal(got, expected)


def test_a_module_whose_input_has_no_name_is_named_with_the_keyword() -> None:
    class Forwarding(nn.Linear):
        def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            return super().forward(*args, **kwargs)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = Forwarding(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(input=x)

    model = Model()
    before = _state(model)
    with pytest.raises(ValueError, match=r"input of 'fc' \(Forwarding\).*first parameter 'args'.*\['input'\]"):
        LRP(model)(torch.randn(2, 3), target=0)
    assert _same(before, _state(model))


# -- the model as it was found, and errors ------------------------------------------------------------------------
def _state(model: nn.Module) -> list[tuple]:
    tensors = [(k, v.clone()) for k, v in model.state_dict().items()]
    return [
        tensors,
        [m.training for m in model.modules()],
        [(p.requires_grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()],
        [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks)) for m in model.modules()],
    ]


def _same(a: list[tuple], b: list[tuple]) -> bool:
    tensors_a, *rest_a = a
    tensors_b, *rest_b = b
    if [k for k, _ in tensors_a] != [k for k, _ in tensors_b]:
        return False
    if not all(torch.equal(u, v) for (_, u), (_, v) in zip(tensors_a, tensors_b, strict=True)):
        return False
    flags_a, grads_a, hooks_a = rest_a
    flags_b, grads_b, hooks_b = rest_b
    same_grads = all(
        ra == rb and ((ga is None and gb is None) or (ga is not None and gb is not None and torch.equal(ga, gb)))
        for (ra, ga), (rb, gb) in zip(grads_a, grads_b, strict=True)
    )
    return flags_a == flags_b and same_grads and hooks_a == hooks_b


def test_the_model_is_left_as_it_was_found() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)
    ).train()
    model[1].running_var.fill_(2.0)
    model[4].weight.grad = torch.ones_like(model[4].weight)
    model[0].weight.requires_grad_(False)
    before = _state(model)
    grad_mode = torch.is_grad_enabled()
    LRP(model)(torch.randn(2, 3, 6, 6), target=1)
    assert _same(before, _state(model))
    assert torch.is_grad_enabled() == grad_mode
    with torch.no_grad():
        LRP(model)(torch.randn(2, 3, 6, 6), target=1)
    assert _same(before, _state(model))
    with pytest.raises(ValueError, match="out of range"):
        LRP(model)(torch.randn(2, 3, 6, 6), target=7)
    assert _same(before, _state(model))


def test_the_forward_output_is_unchanged_by_observing() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Flatten(), nn.Linear(64, 2)).eval()
    x = torch.randn(2, 3, 6, 6)
    outputs = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output.detach().clone()))
    try:
        expected = model(x).detach()
        LRP(model)(x, target=1)
    finally:
        handle.remove()
    assert torch.equal(outputs[-1], expected)


def test_modules_without_a_rule_are_named_with_a_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1' \(LayerNorm\).*layer_map=\[\(torch.nn.LayerNorm, Pass\(\)\)\]"):
        LRP(model)(torch.randn(2, 4), target=0)
    relevance = LRP(model, EpsilonPlusFlat(layer_map=[(nn.LayerNorm, Pass())]))(torch.randn(2, 4), target=0)
    assert relevance.shape == (2, 4)


def test_a_rule_for_layers_on_another_module_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1' \(Tanh: Epsilon.*conv/linear layers only"):
        LRP(model, Composite([(nn.Linear, Epsilon()), (nn.Tanh, Epsilon())]))(torch.randn(2, 4), target=0)


def test_bad_inputs_and_composites_are_refused(two_layers: nn.Sequential) -> None:
    with pytest.raises(TypeError, match="`inputs` must be a floating-point tensor"):
        LRP(two_layers)(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="`composite` must be"):
        LRP(two_layers, composite="epsilon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 items"):
        LRP(two_layers)(torch.randn(3, 4, dtype=torch.float64), target=[0, 1])


def test_a_zero_target_logit_warns(two_layers: nn.Sequential) -> None:
    model = nn.Sequential(two_layers, nn.ReLU())
    x = torch.randn(4, 4, dtype=torch.float64)
    dead = int((model(x) == 0).all(0).nonzero()[0]) if bool((model(x) == 0).all(0).any()) else None
    if dead is None:
        with torch.no_grad():
            two_layers[2].bias[1] = -100.0
        dead = 1
    with pytest.warns(UserWarning, match="all zeros"):
        LRP(model, Composite([(nn.Linear, Epsilon())]))(x, target=dead)


class _Interrupt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


def test_ctrl_c_during_the_forward_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).train()
    before = _state(model)
    broken = nn.Sequential(model, _Interrupt())
    composite = EpsilonPlusFlat(layer_map=[(_Interrupt, Pass())])
    with pytest.raises(KeyboardInterrupt):
        LRP(broken, composite)(torch.randn(2, 3, 6, 6), target=0)
    assert _same(before, _state(model))
    assert torch.is_grad_enabled()
