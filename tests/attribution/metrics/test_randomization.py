"""The randomisation test: the stages, the copies, invariants of the CAMs, and the user's model never touched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attribution import EigenCAM, GradCAM
from attribution.metrics import randomization_test
from attribution.metrics.randomization import default_layers, stage_seed
from tests.support import hook_state


def gradcam(model: nn.Module, x: torch.Tensor, target: object) -> torch.Tensor:
    return GradCAM(model, "features.2")(x, target)


def eigencam(model: nn.Module, x: torch.Tensor, target: object) -> torch.Tensor:
    return EigenCAM(model, "features.2")(x, target)


def test_default_stages_run_from_the_output_down(tiny_cnn, resnet18):
    assert default_layers(tiny_cnn) == ["fc", "features.2", "features.0"]
    layers = default_layers(resnet18)
    assert layers[:3] == ["fc", "layer4.1", "layer4.0"] and layers[-3:] == ["layer1.0", "bn1", "conv1"]


def test_cascading_and_independent_stages(tiny_cnn):
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    parameters = {k: v.clone() for k, v in tiny_cnn.state_dict().items()}
    hooks, rng = hook_state(tiny_cnn), torch.random.get_rng_state()
    cascading = randomization_test(gradcam, tiny_cnn, images, seed=3)
    independent = randomization_test(gradcam, tiny_cnn, images, mode="independent", seed=3)
    # the user's model and the global random state are untouched
    assert all(torch.equal(tiny_cnn.state_dict()[k], v) for k, v in parameters.items())
    assert hook_state(tiny_cnn) == hooks and torch.equal(torch.random.get_rng_state(), rng)
    assert cascading.stages == independent.stages == ["fc", "features.2", "features.0"]
    assert cascading.maps.shape == (3, 2, 16, 16) and cascading.spearman.shape == cascading.ssim.shape == (3, 2)
    torch.testing.assert_close(cascading.original, gradcam(tiny_cnn, images, None))
    # stage 0 randomises the same layer with the same seed in both modes
    torch.testing.assert_close(cascading.maps[0], independent.maps[0])
    # independent stage 1 by hand: a copy with only features.2 re-initialised from stage 1's seed
    by_hand = copy.deepcopy(tiny_cnn)
    torch.manual_seed(stage_seed(3, 1))
    by_hand.features[2].reset_parameters()
    with torch.no_grad():
        top = tiny_cnn(images).argmax(dim=1).tolist()  # target None: the original model's classes throughout
    torch.testing.assert_close(independent.maps[1], gradcam(by_hand, images, top))
    # cascading stage 2 has everything re-initialised: the same as re-initialising fc, features.2, features.0
    by_hand = copy.deepcopy(tiny_cnn)
    for stage, layer in enumerate([by_hand.fc, by_hand.features[2], by_hand.features[0]]):
        torch.manual_seed(stage_seed(3, stage))
        layer.reset_parameters()
    torch.testing.assert_close(cascading.maps[2], gradcam(by_hand, images, top))
    torch.testing.assert_close(cascading.ssim[0], cascading.ssim[0].clamp(max=1.0))


def test_eigencam_ignores_the_classifier_and_gradcam_does_not(tiny_cnn):
    images = torch.randn(2, 3, 16, 16)
    with pytest.warns(UserWarning, match="did not change at any stage"):
        eigen = randomization_test(eigencam, tiny_cnn, images, layers="fc")
    assert eigen.stages == ["fc"]
    torch.testing.assert_close(eigen.spearman, torch.ones(1, 2))  # class-agnostic: the same map exactly
    torch.testing.assert_close(eigen.ssim, torch.ones(1, 2))
    grad = randomization_test(gradcam, tiny_cnn, images, layers="fc")
    assert (grad.spearman < 0.99).all()
    spearman = randomization_test(eigencam, tiny_cnn, images, layers=["features.0"], mode="independent").spearman
    assert (spearman < 0.99).all()  # but the features below the layer change it


def test_reinitialisation_resets_batch_norm_and_redraws_other_parameters():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.full((4,), 5.0) + torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale[None, :, None, None]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), Scaled()).eval()
    with torch.no_grad():
        model[1].running_mean.fill_(3.0)
        model[1].weight.fill_(2.0)
    seen = []

    def method(m: nn.Module, x: torch.Tensor, t: object) -> torch.Tensor:
        seen.append((m[1].running_mean.clone(), m[1].weight.clone(), m[2].scale.clone()))
        return m(x).sum(dim=1)

    randomization_test(method, model, torch.randn(1, 3, 12, 12), lambda out: out.sum((1, 2, 3)))
    mean, weight, scale = seen[2]  # stage 1 of 3: "2" then "1" re-initialised
    assert mean.abs().sum() == 0 and (weight == 1).all()  # batch norm as constructed
    assert not torch.equal(scale, model[2].scale) and scale.std() > 0  # redrawn around its own mean and spread
    assert model[1].running_mean.eq(3).all() and model[1].weight.eq(2).all()


def test_warnings_and_errors(tiny_cnn):
    images = torch.randn(2, 3, 16, 16)
    captured = GradCAM(tiny_cnn, "features.2")
    with pytest.warns(UserWarning, match="did not change at any stage"):
        randomization_test(lambda m, x, t: captured(x, t), tiny_cnn, images)
    with pytest.warns(UserWarning, match="smaller than SSIM's 11x11 window"):
        small = randomization_test(lambda m, x, t: GradCAM(m, "features.2")(x[..., :8, :8], t), tiny_cnn, images)
    assert torch.isnan(small.ssim).all()
    maps = gradcam(tiny_cnn, images, None)
    every_stage = r"constant \(e.g. all zero\) at stage\(s\) \['fc', 'features.2', 'features.0'\]"
    with pytest.warns(UserWarning, match=every_stage):
        flat = randomization_test(lambda m, x, t: maps if m is tiny_cnn else torch.zeros_like(maps), tiny_cnn, images)
    assert torch.isnan(flat.spearman).all() and not torch.isnan(flat.ssim).any()
    with pytest.raises(ValueError, match=r"`method` must return maps of shape \(B, H, W\); got \(2, 1, 16, 16\)"):
        randomization_test(lambda m, x, t: gradcam(m, x, t)[:, None], tiny_cnn, images)
    with pytest.raises(ValueError, match="`mode` must be 'cascading' or 'independent'"):
        randomization_test(gradcam, tiny_cnn, images, mode="successive")
    with pytest.raises(ValueError, match="`layers` 'pool' has no parameters"):
        randomization_test(gradcam, tiny_cnn, images, layers="pool")
    with pytest.raises(KeyError, match="did you mean"):
        randomization_test(gradcam, tiny_cnn, images, layers="feature.2")


def test_an_interrupted_test_leaves_the_model_and_the_random_state_alone(tiny_cnn):
    images = torch.randn(2, 3, 16, 16)
    parameters = {k: v.clone() for k, v in tiny_cnn.state_dict().items()}
    rng, calls = torch.random.get_rng_state(), []

    def interrupted(m: nn.Module, x: torch.Tensor, t: object) -> torch.Tensor:
        calls.append(m)
        if len(calls) == 3:  # the second randomised stage
            raise KeyboardInterrupt
        return gradcam(m, x, t)

    with pytest.raises(KeyboardInterrupt):
        randomization_test(interrupted, tiny_cnn, images)
    assert calls[0] is tiny_cnn and calls[1] is not tiny_cnn  # the original maps, then a copy
    assert all(torch.equal(tiny_cnn.state_dict()[k], v) for k, v in parameters.items())
    assert torch.equal(torch.random.get_rng_state(), rng) and tiny_cnn.training is False


def test_maps_are_compared_after_min_max_scaling_and_one_image_is_a_batch_of_one(tiny_cnn):
    images = torch.randn(2, 3, 16, 16)
    maps = gradcam(tiny_cnn, images, None)
    rescaled = randomization_test(lambda m, x, t: maps if m is tiny_cnn else 5 * maps - 3, tiny_cnn, images)
    torch.testing.assert_close(rescaled.spearman, torch.ones(3, 2))  # an affine map of a map is the same map
    torch.testing.assert_close(rescaled.ssim, torch.ones(3, 2))
    single = randomization_test(gradcam, tiny_cnn, images[1], layers="fc")  # (C, H, W) in, (H, W) maps out
    batch = randomization_test(gradcam, tiny_cnn, images, layers="fc")
    assert single.maps.shape == (1, 1, 16, 16)
    torch.testing.assert_close(single.maps[:, 0], batch.maps[:, 1])
    torch.testing.assert_close(single.spearman[:, 0], batch.spearman[:, 1])
