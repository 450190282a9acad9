"""Known answers in float64: closed forms on linear models, slow re-implementations, windows worked out by hand."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from attribution import LIME, RISE, FeatureAblation, KernelSHAP, Occlusion, ShapleyValues, ShapleyValueSampling
from attribution.perturbation._masks import rise_masks

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def linear(d: int = 6, classes: int = 3, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d, classes).double()


class Interactions(nn.Module):
    """A non-additive function of 4 inputs: pairwise and triple products and a sine; 2 outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = x.unbind(1)
        first = a * b - 2 * b * c * d + torch.sin(d) + 0.5 * a
        return torch.stack([first, a * d], 1)


def slow_shapley(f, x: torch.Tensor, base: torch.Tensor, features: list[list[int]]) -> torch.Tensor:
    """Shapley values straight from the definition: the mean marginal gain over every permutation of the features."""
    m = len(features)
    phi = torch.zeros(m, dtype=torch.float64)
    perms = list(itertools.permutations(range(m)))
    for perm in perms:
        current = base.clone()
        before = f(current)
        for i in perm:
            current[features[i]] = x[features[i]]
            after = f(current)
            phi[i] += after - before
            before = after
    return phi / len(perms)


# -- feature ablation and Shapley values: coefficient x (x - baseline) on linear models -------------------------
@pytest.mark.parametrize("method", ["ablation", "exact", "sampling", "kernel", "lime"])
def test_linear_model_gets_coefficient_times_difference_per_feature(method):
    model = linear()
    x = torch.randn(2, 6, dtype=torch.float64)
    base = torch.randn(6, dtype=torch.float64)
    mask = torch.tensor([0, 2, 1, 2, 3, 0])
    build = {
        "ablation": lambda: FeatureAblation(model, mask, base),
        "exact": lambda: ShapleyValues(model, mask, base),
        "sampling": lambda: ShapleyValueSampling(model, mask, base, samples=3, seed=1),
        "kernel": lambda: KernelSHAP(model, mask, base),
        "lime": lambda: LIME(model, mask, base, samples=40),
    }[method]
    got = build()(x, target=[2, 0])
    contribution = torch.stack([model.weight[2], model.weight[0]]) * (x - base)  # (2, 6)
    per_feature = torch.zeros(2, 4, dtype=torch.float64).index_add_(1, mask, contribution)
    torch.testing.assert_close(got, per_feature[:, mask], rtol=1e-9, atol=1e-9)


def test_feature_ablation_of_a_nonlinear_model_is_the_drop_when_each_feature_goes():
    model = Interactions()
    x = torch.tensor([[0.5, -1.5, 2.0, 0.3]], dtype=torch.float64)
    base = torch.tensor([0.1, 0.2, -0.3, 0.4], dtype=torch.float64)
    got = FeatureAblation(model, baseline=base)(x, target=0)
    expected = []
    for i in range(4):
        ablated = x.clone()
        ablated[0, i] = base[i]
        expected.append(model(x)[0, 0] - model(ablated)[0, 0])
    torch.testing.assert_close(got[0], torch.stack(expected), **TIGHT)


def test_exact_shapley_and_all_coalition_kernel_shap_equal_the_permutation_definition_with_interactions():
    model = Interactions()
    x = torch.tensor([[0.5, -1.5, 2.0, 0.3], [1.0, 0.7, -0.4, -2.0]], dtype=torch.float64)
    base = torch.tensor([0.1, 0.2, -0.3, 0.4], dtype=torch.float64)
    exact = ShapleyValues(model, baseline=base)(x, target=0)
    kernel = KernelSHAP(model, baseline=base, samples=14)(x, target=0)  # 14 = 2^4 - 2: every coalition once
    for b in range(2):
        reference = slow_shapley(lambda v: model(v[None])[0, 0], x[b], base.clone(), [[0], [1], [2], [3]])
        torch.testing.assert_close(exact[b], reference, **TIGHT)
        torch.testing.assert_close(kernel[b], reference, rtol=1e-9, atol=1e-10)
    # efficiency: the values add up to S(x) - S(baseline)
    gain = model(x)[:, 0] - model(base[None])[0, 0]
    torch.testing.assert_close(exact.sum(1), gain, **TIGHT)


def test_sampled_kernel_shap_is_efficient_and_near_the_exact_values():
    model = Interactions()
    x = torch.tensor([[0.5, -1.5, 2.0, 0.3]], dtype=torch.float64)
    exact = ShapleyValues(model)(x, target=0)
    sampled = KernelSHAP(model, samples=400, seed=3)(x, target=0)
    torch.testing.assert_close(sampled.sum(), exact.sum(), **TIGHT)
    assert (sampled - exact).abs().max() < 0.25 * exact.abs().max()


def test_shapley_sampling_averages_the_marginal_gains_along_its_permutations():
    model = Interactions()
    x = torch.tensor([[0.5, -1.5, 2.0, 0.3]], dtype=torch.float64)
    got = ShapleyValueSampling(model, samples=5, seed=7)(x, target=0)
    generator = torch.Generator().manual_seed(7)
    phi = torch.zeros(4, dtype=torch.float64)
    for _ in range(5):
        current = torch.zeros(4, dtype=torch.float64)
        before = model(current[None])[0, 0]
        for i in torch.randperm(4, generator=generator).tolist():
            current[i] = x[0, i]
            after = model(current[None])[0, 0]
            phi[i] += after - before
            before = after
    torch.testing.assert_close(got[0], phi / 5, **TIGHT)


def test_lime_recovers_a_linear_model_on_groups_with_every_sample_weight():
    model = linear(d=8, classes=2, seed=4)
    x = torch.randn(1, 8, dtype=torch.float64)
    mask = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    for width in (0.3, 1.0, 5.0):
        got = LIME(model, mask, samples=30, kernel_width=width, seed=2)(x, target=1)
        expected = torch.zeros(1, 4, dtype=torch.float64).index_add_(1, mask, model.weight[1] * x)[:, mask]
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-9)


# -- occlusion: windows worked out by hand --------------------------------------------------------------------
def test_occlusion_cuts_the_last_window_at_the_edge_as_captum():
    model = nn.Linear(5, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    got = Occlusion(model, window=(2,), stride=(2,))(torch.ones(1, 5, dtype=torch.float64), target=0)
    # windows [0, 2), [2, 4), [4, 5): drops 3, 7, 5, each element covered once
    torch.testing.assert_close(got, torch.tensor([[3.0, 3.0, 7.0, 7.0, 5.0]], dtype=torch.float64))


def test_occlusion_averages_overlapping_windows_on_a_non_square_item():
    torch.manual_seed(0)
    weight = torch.randn(2 * 3 * 4, dtype=torch.float64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(24, 1, bias=False)).double()
    with torch.no_grad():
        model[1].weight.copy_(weight[None])
    x = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    base = torch.randn(2, 3, 4, dtype=torch.float64)
    got = Occlusion(model, window=(1, 2, 3), stride=(1, 1, 2), baseline=base)(x, target=0)
    contribution = weight.view(2, 3, 4) * (x - base)  # the drop of a window = the sum of its contributions
    total = torch.zeros_like(x)
    count = torch.zeros(2, 3, 4, dtype=torch.float64)
    for c, i, j in itertools.product(range(2), range(2), (0, 2)):  # windows along W start at 0 and 2 (cut: 2..3)
        where = (slice(c, c + 1), slice(i, i + 2), slice(j, j + 3))
        total[(slice(None), *where)] += contribution[(slice(None), *where)].sum((1, 2, 3)).view(2, 1, 1, 1)
        count[where] += 1
    torch.testing.assert_close(got, total / count, **TIGHT)


# -- RISE -------------------------------------------------------------------------------------------------------
def test_rise_masks_are_upsampled_grids_cropped_at_their_shift_on_non_square_images():
    grids = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(0)).round()
    shifts = torch.tensor([[0, 0], [1, 2], [2, 3]])
    got = rise_masks(grids, shifts, (6, 15))  # cells of 2 x 4 pixels
    for n in range(3):
        up = nn.functional.interpolate(grids[n][None, None].double(), size=(10, 20), mode="bilinear")[0, 0]
        dy, dx = shifts[n].tolist()
        torch.testing.assert_close(got[n], up[dy : dy + 6, dx : dx + 15], **TIGHT)


def test_rise_is_the_mask_weighted_mean_of_the_scores():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 7, 3)).double()
    x = torch.randn(1, 2, 5, 7, dtype=torch.float64)
    method = RISE(model, masks=20, cell=3, p=0.3, seed=5)
    got = method(x, target=1)
    grids, shifts = method._draw(5, 7)
    masks = rise_masks(grids, shifts, (5, 7))
    expected = sum(model(x * m)[0, 1] * m for m in masks) / (20 * 0.3)
    torch.testing.assert_close(got[0], expected.expand(2, 5, 7), **TIGHT)


def test_rise_puts_the_maximum_on_the_one_pixel_the_model_reads():
    class OnePixel(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :, 2, 5].sum(1, keepdim=True)

    saliency = RISE(OnePixel(), masks=300, cell=4)(torch.ones(1, 3, 6, 9, dtype=torch.float64), target=0)
    assert divmod(int(saliency[0, 0].argmax()), 9) == (2, 5)


# -- batching ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_forward", [1, 3, None])
def test_perturbations_per_forward_does_not_change_the_result(per_forward):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    mask = torch.arange(12).view(1, 3, 4) // 3
    options = {"perturbations_per_forward": per_forward, "show_progress": False}
    methods = [
        Occlusion(model, (1, 2, 2), (1, 1, 2), **options),
        FeatureAblation(model, mask, **options),
        ShapleyValues(model, mask, **options),
        ShapleyValueSampling(model, mask, samples=4, **options),
        KernelSHAP(model, mask, samples=9, **options),
        LIME(model, mask, samples=9, **options),
        RISE(model, masks=7, cell=2, **options),
    ]
    reference = [m.__class__(model, *_args(m), perturbations_per_forward=10**6)(x, target=[0, 2]) for m in methods]
    for method, expected in zip(methods, reference, strict=True):
        torch.testing.assert_close(method(x, target=[0, 2]), expected, **TIGHT)
        count = method.forwards - 1
        assert per_forward is None or count == math.ceil(_perturbations(method) / per_forward)


def _args(method) -> tuple:
    name = type(method).__name__
    if name == "Occlusion":
        return (method.window, method.stride)
    if name == "RISE":
        return (method.masks, method.cell)
    if name == "ShapleyValueSampling":
        return (method.feature_mask, None, method.samples)
    if name in ("KernelSHAP", "LIME"):
        return (method.feature_mask, None, method.samples)
    return (method.feature_mask,)


def _perturbations(method) -> int:
    return {
        "Occlusion": 2 * 2,
        "FeatureAblation": 4,
        "ShapleyValues": 15,
        "ShapleyValueSampling": 1 + 4 * 3,
        "KernelSHAP": 1 + 9,
        "LIME": 9,
        "RISE": 7,
    }[type(method).__name__]


def test_lime_on_a_nonlinear_model_equals_a_slow_weighted_fit_with_captums_kernel():
    model = Interactions()
    x = torch.tensor([[0.5, -1.5, 2.0, 0.3]], dtype=torch.float64)
    base = torch.tensor([0.1, 0.2, -0.3, 0.4], dtype=torch.float64)
    got = LIME(model, baseline=base, samples=12, kernel_width=0.7, seed=5)(x, target=0)
    keep = torch.rand(12, 4, generator=torch.Generator().manual_seed(5)) < 0.5
    rows, values, weights = [], [], []
    for z in keep:
        perturbed = torch.where(z, x[0], base)
        distance = 1 - nn.functional.cosine_similarity(x[0], perturbed, dim=0)
        weights.append(torch.exp(-(distance**2) / (2 * 0.7**2)))
        rows.append(torch.cat([z.double(), torch.ones(1, dtype=torch.float64)]))
        values.append(model(perturbed[None])[0, 0])
    root = torch.stack(weights).sqrt()
    A, y = torch.stack(rows) * root[:, None], torch.stack(values) * root
    expected = torch.linalg.lstsq(A, y[:, None], driver="gelsd").solution[:4, 0]
    torch.testing.assert_close(got[0], expected, rtol=1e-8, atol=1e-10)
