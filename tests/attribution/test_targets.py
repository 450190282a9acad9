"""What ``target=`` accepts and the target helpers (class logits, segmentation, detection), worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attribution import GradCAM, targets


def hand_gradcam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    return F.relu((grads.mean((2, 3), keepdim=True) * acts).sum(1))


@pytest.mark.parametrize(
    "target", [np.int64(2), torch.tensor(2), np.array([2, 2, 2]), [np.int32(2)] * 3, torch.tensor([2, 2, 2])]
)
def test_targets_as_numpy_and_tensor_integers(tiny_cnn, target, no_warnings):
    x = torch.randn(3, 3, 8, 8)
    cam = GradCAM(tiny_cnn, "features.2")
    torch.testing.assert_close(cam(x, target, normalize=False), cam(x, 2, normalize=False))


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        (True, TypeError, "got a bool"),
        (2.0, TypeError, "got float"),
        (np.array([1.0, 2.0, 3.0]), TypeError, r"integer class indices.*float64"),
        (np.array([[1, 2, 3]]), TypeError, r"of shape \(1, 3\)"),
        ([1, 2], ValueError, "has 2 entries but the batch has 3 items"),
    ],
)
def test_bad_targets_are_refused_before_any_forward(tiny_cnn, target, error, match):
    calls = []
    handle = tiny_cnn.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(error, match=match):
            GradCAM(tiny_cnn, "features.2")(torch.randn(3, 3, 8, 8), target)
    finally:
        handle.remove()
    assert calls == []


def test_class_logit_reads_tensors_and_model_outputs():
    transformers = pytest.importorskip("transformers")
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, -1.0]])
    torch.testing.assert_close(targets.ClassLogit(2)(logits), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(targets.ClassLogit(np.array([1, 0]))(logits), torch.tensor([2.0, 3.0]))
    output = transformers.modeling_outputs.SequenceClassifierOutput(logits=logits)
    torch.testing.assert_close(targets.ClassLogit([1, 0])(output), torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="class 3 is out of range"):
        targets.ClassLogit(3)(logits)


def test_segmentation_scores_worked_out_by_hand():
    out = torch.zeros(2, 3, 2, 2)
    out[0, 1] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out[1, 1] = torch.tensor([[1.0, -5.0], [6.0, 0.5]])
    # predicted class 1 where its logit beats 0: image 0 everywhere, image 1 at three pixels (not the -5)
    torch.testing.assert_close(targets.Segmentation(1)({"out": out, "aux": out}), torch.tensor([10.0, 7.5]))
    mask = torch.tensor([[True, False], [False, True]])
    torch.testing.assert_close(targets.Segmentation(1, mask)(out), torch.tensor([5.0, 1.5]))
    torch.testing.assert_close(targets.Segmentation([1, 0], mask)(out), torch.tensor([5.0, 0.0]))
    with pytest.raises(ValueError, match=r"`mask` must be \(H, W\) or \(batch, H, W\)"):
        targets.Segmentation(1, torch.ones(3, 3))(out)


def test_detection_takes_the_best_matching_box_of_the_label():
    output = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10], [50, 50, 60, 60]]),
            "labels": torch.tensor([3, 3, 7, 3]),
            "scores": torch.tensor([0.5, 0.9, 0.8, 0.7]),
        },
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long), "scores": torch.zeros(0)},
    ]
    box = [[0.0, 0, 10, 10]]
    # image 0: label 3 matches box 0 (IoU 1.0, score 0.5) better than box 1 (IoU 0.68); label 7 gives 0.8
    detection = targets.Detection([[3, 7], [3]], [box * 2, box])
    with pytest.warns(UserWarning, match=r"image 1: no detection of label 3 has IoU >= 0.5"):
        scores = detection(output)
    torch.testing.assert_close(scores, torch.tensor([1.3, 0.0]))
    with pytest.raises(ValueError, match="2 labels but 1 boxes"):
        targets.Detection([[3, 7]], [box])


def test_segmentation_on_torchvision_deeplab(no_warnings):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        category = int(model(x)["out"].argmax(1).flatten().mode().values)
    layer = "backbone.16"
    maps = GradCAM(model, layer)(x, targets.Segmentation(category), normalize=False, upsample=False)
    acts = model.backbone(x)["out"].detach().requires_grad_(True)
    out = F.interpolate(model.classifier(acts), size=(64, 64), mode="bilinear", align_corners=False)
    region = (out.detach().argmax(1) == category).float()
    grads = torch.autograd.grad((out[:, category] * region).sum(), acts)[0]
    torch.testing.assert_close(maps, hand_gradcam(acts.detach(), grads))


def test_detection_on_torchvision_faster_rcnn_with_a_list_of_images(no_warnings):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0, min_size=128, max_size=128
    ).eval()
    images = [torch.rand(3, 128, 128), torch.rand(3, 128, 128)]
    with torch.no_grad():
        found = model(images)
    labels = [found[i]["labels"][:1] for i in range(2)]
    boxes = [found[i]["boxes"][:1] for i in range(2)]
    maps = GradCAM(model, "backbone.body.16")(images, targets.Detection(labels, boxes))
    assert maps.shape == (2, 128, 128) and bool((maps.flatten(1).amax(1) == 1).all())
    one = GradCAM(model, "backbone.body.16")([images[1]], targets.Detection(labels[1:], boxes[1:]))
    torch.testing.assert_close(one[0], maps[1], rtol=1e-4, atol=1e-4)  # batch of one vs two: float rounding
