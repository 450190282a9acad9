"""``layer=``: a module's output perturbed; the model runs up to it once and later forwards replay that part.

Known answers in float64 where what follows the layer is linear (ablating unit ``i`` drops the score by
``W[t, i] (a_i - b_i)``), and equality with a plain implementation that re-runs the whole model once per
perturbation with a forward hook replacing the layer's output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import FeatureAblation, Occlusion, ShapleyValueSampling
from attribution.perturbation._layer import repeated
from attribution.perturbation._masks import occlusion_starts, window_masks

from ...support import hook_state
from ..models import lm64

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


class Counted(nn.Module):
    """A module that counts its forward calls (no hooks: a hooked module is never replayed)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def conv_net(seed: int = 0, linear_head: bool = False) -> nn.Sequential:
    """Conv -> ReLU (the layer, ``"1"``) -> [tanh] -> flatten -> linear: ``(batch, 2, 4, 5)`` -> 3 classes."""
    torch.manual_seed(seed)
    head = [nn.Flatten(), nn.Linear(3 * 4 * 5, 3)] if linear_head else [nn.Tanh(), nn.Flatten(), nn.Linear(60, 3)]
    return nn.Sequential(Counted(nn.Conv2d(2, 3, 3, padding=1)), nn.ReLU(), *head).double().eval()


def plain_scores(model, layer, x, target, perturbed) -> list[torch.Tensor]:
    """The target score ``(batch,)`` of each perturbed activation, a full re-run with a hook replacing the output."""
    out = []
    for activation in perturbed:
        handle = layer.register_forward_hook(lambda m, a, o, act=activation: act)
        try:
            with torch.no_grad():
                out.append(model(x)[torch.arange(len(x)), target])
        finally:
            handle.remove()
    return out


def activation_of(model, layer, x) -> torch.Tensor:
    seen = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def plain_ablation(model, layer, x, target, ids, base) -> torch.Tensor:
    a = activation_of(model, layer, x)
    count = int(ids.max()) + 1
    full = plain_scores(model, layer, x, target, [a])[0]
    drops = plain_scores(model, layer, x, target, [torch.where(ids == i, base, a) for i in range(count)])
    return torch.stack([full - d for d in drops], 1)[:, ids]


def plain_occlusion(model, layer, x, target, window, stride, base) -> torch.Tensor:
    a = activation_of(model, layer, x)
    item = tuple(a.shape[1:])
    corners = occlusion_starts(item, window, stride)
    masks = window_masks(item, window, corners)
    full = plain_scores(model, layer, x, target, [a])[0]
    scores = plain_scores(model, layer, x, target, [torch.where(m, base, a) for m in masks])
    total = torch.zeros_like(a)
    for m, s in zip(masks, scores, strict=True):
        total += m * (full - s).view(-1, *([1] * len(item)))
    return total / masks.sum(0)


def plain_sampling(model, layer, x, target, ids, base, samples, seed) -> torch.Tensor:
    a = activation_of(model, layer, x)
    count = int(ids.max()) + 1
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(len(x), count, dtype=torch.float64)
    for _ in range(samples):
        permutation = torch.randperm(count, generator=generator)
        kept = torch.zeros(count, dtype=torch.bool)
        before = plain_scores(model, layer, x, target, [torch.where(kept[ids], a, base)])[0]
        for i in permutation.tolist():
            kept[i] = True
            after = plain_scores(model, layer, x, target, [torch.where(kept[ids], a, base)])[0]
            total[:, i] += after - before
            before = after
    return (total / samples)[:, ids]


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randn(2, 2, 4, 5, dtype=torch.float64)


# -- known answers ------------------------------------------------------------------------------------------------
def test_ablation_of_a_unit_before_a_linear_head_is_its_weight_times_its_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    base = torch.linspace(-0.5, 0.7, 6, dtype=torch.float64)
    a = torch.tanh(model[0](x)).detach()
    weight = model[2].weight.detach()
    target = torch.tensor([2, 0, 1])
    got = FeatureAblation(model, baseline=base, layer="1")(x, target=target)
    torch.testing.assert_close(got, weight[target] * (a - base), **TIGHT)
    groups = torch.tensor([0, 1, 1, 0, 2, 2])  # a feature's drop is the sum over its units
    got = FeatureAblation(model, groups, 0.25, layer=model[1])(x, target=1)
    drops = torch.stack([(weight[1] * (a - 0.25) * (groups == g)).sum(1) for g in range(3)], 1)
    torch.testing.assert_close(got, drops[:, groups], **TIGHT)
    # Shapley values of a linear function: the same, exactly, whatever the permutations
    svs = ShapleyValueSampling(model, groups, 0.25, samples=3, layer="1")(x, target=1)
    torch.testing.assert_close(svs, drops[:, groups], **TIGHT)


def test_occlusion_of_a_feature_map_before_a_linear_head_worked_out(x):
    model = conv_net(linear_head=True)
    a = torch.relu(model[0](x)).detach()  # (2, 3, 4, 5)
    weight = model[3].weight.detach().view(3, 3, 4, 5)
    got = Occlusion(model, (3, 4, 5), layer="1")(x, target=2)  # one window, the whole map: the logit's change
    expected = (weight[2] * a).sum((1, 2, 3))
    torch.testing.assert_close(got, expected.view(2, 1, 1, 1).expand_as(a), **TIGHT)
    got = Occlusion(model, (1, 4, 5), layer="1")(x, target=2)  # one window per channel
    torch.testing.assert_close(got, (weight[2] * a).sum((2, 3), keepdim=True).expand_as(a), **TIGHT)


# -- equal to the plain re-run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_forward", [1, 3, None])
def test_the_three_methods_equal_a_plain_rerun_with_the_layer_output_replaced(x, per_forward):
    model = conv_net()
    layer = model[1]
    ids = (torch.arange(20).view(1, 4, 5) // 5).expand(3, 4, 5) + 4 * torch.arange(3).view(3, 1, 1)  # 12 features
    base = torch.full((3, 4, 5), 0.2, dtype=torch.float64)
    target = torch.tensor([0, 2])
    per = {"perturbations_per_forward": per_forward}
    got = FeatureAblation(model, ids, base, layer="1", **per)(x, target=target)
    torch.testing.assert_close(got, plain_ablation(model, layer, x, target, ids, base), **TIGHT)
    got = Occlusion(model, (2, 2, 3), (1, 2, 2), base, layer="1", **per)(x, target=target)
    torch.testing.assert_close(got, plain_occlusion(model, layer, x, target, (2, 2, 3), (1, 2, 2), base), **TIGHT)
    got = ShapleyValueSampling(model, ids, base, samples=2, seed=3, layer="1", **per)(x, target=target)
    expected = plain_sampling(model, layer, x, target, ids, base, samples=2, seed=3)
    torch.testing.assert_close(got, expected, **TIGHT)


def test_token_ids_with_a_decoder_layer_equal_the_plain_rerun():
    model = lm64("llama")
    ids = torch.tensor([[5, 9, 3, 17, 22, 8], [1, 12, 3, 4, 25, 6]])
    layer = model.model.layers[0]
    mask = torch.arange(6)[:, None].expand(6, 16)  # one feature per position of the residual stream
    got = FeatureAblation(model, mask, layer="model.layers.0", perturbations_per_forward=4)(ids, target=7)
    a = activation_of(model, layer, ids)
    expected = []
    for i in range(6):
        ablated = a.clone()
        ablated[:, i] = 0
        scores = []
        for act in (a, ablated):
            handle = layer.register_forward_hook(lambda m, args, o, act=act: act)
            with torch.no_grad():
                scores.append(torch.log_softmax(model(ids).logits[:, -1], -1)[:, 7])
            handle.remove()
        expected.append(scores[0] - scores[1])
    torch.testing.assert_close(got, torch.stack(expected, 1)[:, :, None].expand(2, 6, 16), **TIGHT)


# -- the model up to the layer runs once --------------------------------------------------------------------------
def test_the_modules_before_the_layer_run_once_and_those_after_it_once_per_forward(x):
    model = conv_net()
    after = model[2] = Counted(model[2])
    method = FeatureAblation(model, layer="1", perturbations_per_forward=7)  # 60 units: 9 batches
    method(x, target=1)
    assert model[0].calls == 1
    assert method.forwards == 1 + 1 + 9  # the traced run, the check run of the replay, the batches
    assert after.calls == method.forwards


def test_replayed_tensors_are_repeated_along_the_batch_only():
    value = {"h": torch.arange(6).view(3, 2), "shared": torch.ones(1, 2), "n": 4}
    out = repeated(value, batch=3, times=2)
    assert torch.equal(out["h"], torch.arange(6).view(3, 2).repeat_interleave(2, 0))
    assert torch.equal(out["shared"], value["shared"]) and out["shared"] is not value["shared"]
    assert out["n"] == 4


class SideEffect(nn.Module):
    """Its pre-layer part stores a per-item value that the part after the layer reads: replay cannot skip it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.layer, self.head = nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)
        self.pre.register_forward_hook(lambda m, a, o: setattr(self, "seen", a[0].sum(1, keepdim=True)))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.head(self.layer(h)) + self.seen


def test_a_module_with_the_users_hook_keeps_running_and_the_answer_is_the_plain_one():
    model = SideEffect().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    got = FeatureAblation(model, layer="layer", perturbations_per_forward=2)(x, target=1)
    expected = plain_ablation(model, model.layer, x, torch.tensor([1, 1, 1]), torch.arange(5), torch.zeros(5))
    torch.testing.assert_close(got, expected, **TIGHT)


class Stores(nn.Module):
    """A linear map that keeps the sum of its input as state, which the model reads after the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.sum(1, keepdim=True)
        return self.linear(x)


class Remembers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.layer, self.head = Stores(), nn.Tanh(), nn.Linear(5, 2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.pre(x))) * self.pre.seen


def test_a_replay_that_breaks_the_model_warns_and_runs_every_module():
    model = Remembers().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="made the model fail"):
        got = FeatureAblation(model, layer="layer", perturbations_per_forward=2)(x, target=0)
    expected = plain_ablation(model, model.layer, x, torch.tensor([0, 0, 0]), torch.arange(5), torch.zeros(5))
    torch.testing.assert_close(got, expected, **TIGHT)


# -- the model left as found, errors ------------------------------------------------------------------------------
def test_the_model_is_left_as_found_also_when_it_raises(x):
    model = conv_net().train()
    before = hook_state(model), [m.training for m in model.modules()], [m.__dict__.get("forward") for m in model]
    FeatureAblation(model, layer="1")(x, target=0)
    after = hook_state(model), [m.training for m in model.modules()], [m.__dict__.get("forward") for m in model]
    assert after == before
    with pytest.raises(ValueError, match="does not broadcast"):
        FeatureAblation(model, torch.zeros(2, 2, dtype=torch.long), layer="1")(x, target=0)
    assert (hook_state(model), [m.training for m in model.modules()]) == before[:2]
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_layer_errors_name_the_layer():
    model = conv_net()
    x = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    with pytest.raises(KeyError, match="did you mean"):
        FeatureAblation(model, layer="11")
    with pytest.raises(ValueError, match="must name one module"):
        FeatureAblation(model, layer="*")
    with pytest.raises(ValueError, match=r"one item of the output of `layer` '1'"):
        FeatureAblation(model, torch.zeros(7, dtype=torch.long), layer="1")(x, target=0)
    with pytest.raises(ValueError, match=r"but the outputs of `layer` '1' are \(1, 3, 4, 5\)"):
        Occlusion(model, (1, 2, 2), baseline=torch.zeros(2, 4, 5), layer="1")(x, target=0)
    twice = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    twice.append(twice[1])  # the same module called twice
    with pytest.raises(ValueError, match="runs more than once"):
        FeatureAblation(nn.Sequential(*twice), layer="1")(torch.randn(1, 3, dtype=torch.float64), target=0)
