"""Target callables against sums written out by hand: float mask weights, per-image categories and masks."""

from __future__ import annotations

import torch

from attribution import GradCAM, targets


def logits() -> torch.Tensor:
    """``(2, 3, 2, 3)`` segmentation logits with distinct values: item, class, row, column."""
    return torch.arange(2 * 3 * 2 * 3, dtype=torch.float64).view(2, 3, 2, 3) / 10 - 1.5


def test_float_mask_weights_each_pixel_by_its_value():
    """Weights of both signs and not 0/1: the score is the weighted sum, not a count of the pixels."""
    mask = torch.tensor([[0.5, 0.0, -2.0], [1.0, 0.25, 3.0]], dtype=torch.float64)
    out = logits()
    got = targets.Segmentation([2, 1], mask=mask)(out)
    expected = torch.stack([(out[0, 2] * mask).sum(), (out[1, 1] * mask).sum()])
    torch.testing.assert_close(got, expected)


def test_a_mask_per_image_goes_with_its_image():
    masks = torch.zeros(2, 2, 3, dtype=torch.float64)
    masks[0, 0, 2] = 1.0  # item 0: the top-right pixel
    masks[1, 1, 0] = 0.5  # item 1: half the bottom-left pixel
    out = {"out": logits()}
    got = targets.Segmentation(1, mask=masks)(out)
    torch.testing.assert_close(got, torch.stack([out["out"][0, 1, 0, 2], 0.5 * out["out"][1, 1, 1, 0]]))


def test_boolean_mask_counts_the_pixels_once():
    mask = torch.tensor([[True, False, True], [False, False, True]])
    out = logits()
    got = targets.Segmentation(0, mask=mask)(out)
    torch.testing.assert_close(got, out[:, 0][:, mask].sum(1))


def test_without_mask_the_pixels_the_category_wins():
    """Class 2 wins where its logit is highest: set it per pixel so that the two items differ."""
    out = torch.zeros(2, 3, 2, 3, dtype=torch.float64)
    out[0, 2, 0, :] = torch.tensor([1.0, 2.0, 3.0])  # item 0: class 2 wins the top row
    out[1, 2, :, 1] = torch.tensor([4.0, 5.0])  # item 1: class 2 wins the middle column
    out[1, 0, 1, 1] = 9.0  # ... except at (1, 1), where class 0 wins
    got = targets.Segmentation(2)(out)
    torch.testing.assert_close(got, torch.tensor([6.0, 4.0], dtype=torch.float64))


def test_class_logit_reads_one_class_per_item():
    out = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    torch.testing.assert_close(targets.ClassLogit([2, 0])(out), torch.tensor([2.0, 3.0]))


class Segmenter(torch.nn.Module):
    """A 1x1 convolution from 2 to 3 channels: logits ``(batch, 3, H, W)`` at the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Conv2d(2, 2, 1)
        self.head = torch.nn.Conv2d(2, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def test_grad_cam_of_a_masked_category_by_hand():
    """Grad-CAM of ``Segmentation(c, mask)``: the gradient of the masked sum is ``W_head[c] * mask`` per position."""
    torch.manual_seed(0)
    model = Segmenter().double().eval()
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    mask = torch.rand(3, 4, dtype=torch.float64) * 2 - 0.5
    got = GradCAM(model, "features")(x, targets.Segmentation(1, mask=mask), upsample=False, normalize=False)
    with torch.no_grad():
        acts = model.features(x)[0]  # (2, 3, 4)
    grads = model.head.weight[1, :, 0, 0].detach()[:, None, None] * mask  # (2, 3, 4)
    expected = torch.relu((grads.mean(dim=(1, 2))[:, None, None] * acts).sum(0))
    torch.testing.assert_close(got[0].double(), expected, rtol=1e-5, atol=1e-6)


def test_without_mask_each_image_uses_its_own_category():
    out = torch.zeros(2, 3, 2, 3, dtype=torch.float64)
    out[0, 2, 1, :] = torch.tensor([1.0, 2.0, 3.0])  # item 0, class 2 wins the bottom row: 6
    out[1, 0, :, 2] = torch.tensor([4.0, 7.0])  # item 1, class 0 wins the right column (and ties elsewhere): 11
    out[1, 1, :, :2] = 0.5  # ... class 1 wins the rest of item 1
    got = targets.Segmentation([2, 0])(out)
    torch.testing.assert_close(got, torch.tensor([6.0, 11.0], dtype=torch.float64))
