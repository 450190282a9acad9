"""The metrics against the peers' own implementations, live, once their conventions are aligned.

torchcam 0.5's ``DeletionInsertionMetric`` and pytorch-grad-cam 1.5's ROAD (``pytorch_grad_cam/metrics/road.py``)
get the same model, inputs and maps. The differences, documented in docs/methods/metrics.rst, are aligned here:

* torchcam's steps are ``ceil(H*W / steps)`` pixels each (the last one shorter), hookscope's ``floor(k H*W /
  steps)``: the same points when ``steps`` divides ``H*W`` (16 steps of 16 pixels here). torchcam's baseline is
  zeros for both curves, hookscope's default for insertion is the blur, so ``baseline="zeros"`` is passed.
* pytorch-grad-cam's ``percentile`` ``p`` removes the pixels at or above the map's ``p``-th percentile (numpy,
  linear interpolation), about ``100 - p`` percent of them; hookscope removes a count, ``round(q / 100 * H*W)``
  for ``q`` percent. The counts are read off pytorch-grad-cam's threshold and passed as ``q``. Its imputation noise
  is drawn from the global random state, so both run with ``noise=0``; its imputer only takes float32.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch
from torch import nn

from attribution.metrics import deletion, deletion_insertion, insertion, road

pytestmark = [pytest.mark.peers, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # numpy, from the peers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


class GivenMaps:
    """A torchcam CAM extractor that returns the given maps, so that both libraries rank pixels by the same map."""

    def __init__(self, model: nn.Module, maps: torch.Tensor) -> None:
        self.model, self.maps = model, maps

    def __call__(self, class_idx: object = None, scores: object = None, normalized: bool = True, **kwargs: object):
        return [self.maps]

    def fuse_cams(self, cams: list[torch.Tensor]) -> torch.Tensor:
        return cams[0]

    def _hooks_off(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture
def setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Net().eval(), torch.randn(3, 3, 16, 16), torch.rand(3, 16, 16)


SOFTMAX = functools.partial(torch.softmax, dim=-1)


@pytest.mark.parametrize(("score", "logits_fn"), [("probability", SOFTMAX), ("logit", None)])
def test_deletion_and_insertion_match_torchcam(setup, score, logits_fn):
    metrics = pytest.importorskip("torchcam.metrics")
    model, images, maps = (part.double() for part in setup)  # float64: the numbers agree to 1e-12
    theirs = metrics.DeletionInsertionMetric(GivenMaps(model, maps), logits_fn, steps=16, batch_size=7)
    theirs.update(images)
    summary = theirs.summary()
    ours_deletion = deletion(model, images, maps, steps=16, score=score)
    ours_insertion = insertion(model, images, maps, steps=16, score=score, baseline="zeros")
    assert ours_deletion.auc.mean().item() == pytest.approx(summary["deletion_auc"], rel=1e-12)
    assert ours_insertion.auc.mean().item() == pytest.approx(summary["insertion_auc"], rel=1e-12)
    both = deletion_insertion(model, images, maps, steps=16, score=score, baselines=("zeros", "zeros"))
    expected = [summary["deletion_auc"], summary["insertion_auc"]]
    assert [r.auc.mean().item() for r in both] == pytest.approx(expected, rel=1e-12)  # one call, shared forwards
    theirs.reset()
    theirs.update(images, class_idx=[4, 0, 2])  # per-item classes, and a blurred baseline for both
    fixed = deletion(model, images, maps, [4, 0, 2], steps=16, score=score)
    assert fixed.auc.mean().item() == pytest.approx(theirs.summary()["deletion_auc"], rel=1e-12)


def test_deletion_matches_torchcam_with_a_blur_baseline(setup):
    metrics = pytest.importorskip("torchcam.metrics")
    model, images, maps = setup
    from attribution.metrics._perturb import blur

    theirs = metrics.DeletionInsertionMetric(GivenMaps(model, maps), SOFTMAX, steps=8, baseline=blur)
    theirs.update(images)
    ours = (deletion(model, images, maps, steps=8, baseline="blur"), insertion(model, images, maps, steps=8))
    assert ours[0].auc.mean().item() == pytest.approx(theirs.summary()["deletion_auc"], rel=1e-6)
    assert ours[1].auc.mean().item() == pytest.approx(theirs.summary()["insertion_auc"], rel=1e-6)


def test_road_matches_pytorch_grad_cam(setup):
    road_module = pytest.importorskip("pytorch_grad_cam.metrics.road")
    confidence = pytest.importorskip("pytorch_grad_cam.metrics.perturbation_confidence")
    model_targets = pytest.importorskip("pytorch_grad_cam.utils.model_targets")
    model, images, maps = setup
    with torch.no_grad():
        classes = model(images).argmax(dim=1).tolist()
    targets = [model_targets.ClassifierOutputSoftmaxTarget(c) for c in classes]
    cams, pixels = maps.numpy(), 16 * 16
    morf_gaps, lerf_gaps = [], []
    for p in (20, 70):
        imputer = road_module.NoisyLinearImputer(noise=0)
        morf = confidence.PerturbationConfidenceMetric(confidence.RemoveMostRelevantFirst(p, imputer))
        lerf = confidence.PerturbationConfidenceMetric(confidence.RemoveLeastRelevantFirst(p, imputer))
        expected_morf = morf(images, cams, targets, model)  # their score after imputation minus the original one
        expected_lerf = lerf(images, cams, targets, model)
        for i in range(3):
            removed = int((cams[i] >= np.percentile(cams[i], p)).sum())
            assert removed == int((1 - cams[i] >= np.percentile(1 - cams[i], p)).sum())  # no ties: one count for both
            ours = road(model, images[i], maps[i], classes[i], percentiles=[100 * removed / pixels], noise=0)
            morf_gaps.append(ours.morf[0, 0].item() - ours.score[0].item() - expected_morf[i])
            lerf_gaps.append(ours.lerf[0, 0].item() - ours.score[0].item() - expected_lerf[i])
    # float32 model; their imputation is rounded to float32 after a float64 solve, ours solved in float32
    np.testing.assert_allclose(morf_gaps, 0, atol=2e-6)
    np.testing.assert_allclose(lerf_gaps, 0, atol=2e-6)


def test_road_combined_matches_pytorch_grad_cam(setup, monkeypatch):
    road_module = pytest.importorskip("pytorch_grad_cam.metrics.road")
    model_targets = pytest.importorskip("pytorch_grad_cam.utils.model_targets")
    model, images, maps = setup
    # ROADCombined builds its imputers with the default noise of 0.01, drawn from the global random state: switch
    # the noise off there (and here) to compare the numbers themselves
    monkeypatch.setattr(road_module.NoisyLinearImputer.__init__, "__defaults__", (0.0, road_module.neighbors_weights))
    targets = [model_targets.ClassifierOutputSoftmaxTarget(c) for c in (1, 3, 0)]
    expected = road_module.ROADCombined(percentiles=[20, 40, 60, 80])(images, maps.numpy(), targets, model)
    # with 256 pixels (no ties), their percentile p keeps the floor((256 - 1) p / 100) + 1 lowest (MoRF) or
    # highest (LeRF) pixels: 205, 154, 103 and 52 removed for 20, 40, 60, 80 (round(q / 100 * 256) would give 102
    # and 51 for the last two)
    removed = torch.tensor([256 - (255 * p // 100 + (255 * p % 100 > 0)) for p in (20, 40, 60, 80)])
    assert removed.tolist() == [205, 154, 103, 52]
    ours = road(model, images, maps, [1, 3, 0], percentiles=(100 * removed / 256).tolist(), noise=0)
    np.testing.assert_allclose(ours.auc.numpy(), expected, atol=2e-6)
