"""Every CAM on a model whose gradient at the layer is known in closed form, on a non-square 3x5 grid.

The head is linear in the layer's activations ``A`` ``(batch, 4, 3, 5)``: the score of class ``c`` is
``sum_kij W[c, k, i, j] A[k, i, j] + b[c]``, so ``dS/dA = W[c]`` and each method's formula is written out below with
loops and plain tensor sums, in float64, item by item (two items explaining different classes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attribution import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM

K, H, W = 4, 3, 5
CLASSES = [2, 0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(2, K, 3, padding=1)
        self.head = nn.Linear(K * H * W, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = Net().double().eval()
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    with torch.no_grad():
        acts = model.features(x)
    grads = model.head.weight.detach().view(3, K, H, W)[CLASSES]  # dS_b/dA_b for each item's class
    return model, x, acts, grads


def grad_cam(a, g):
    return torch.relu(sum(g[k].sum() / (H * W) * a[k] for k in range(K)))


def hires_cam(a, g):
    return torch.relu(sum(g[k] * a[k] for k in range(K)))


def layer_cam(a, g):
    return torch.relu(sum(torch.relu(g[k]) * a[k] for k in range(K)))


def xgrad_cam(a, g):
    return torch.relu(sum((a[k] * g[k]).sum() / a[k].sum() * a[k] for k in range(K)))


def grad_cam_pp(a, g):
    total = torch.zeros(H, W, dtype=torch.float64)
    for k in range(K):
        weight = 0.0
        for i in range(H):
            for j in range(W):
                gij = g[k, i, j]
                denominator = 2 * gij**2 + a[k].sum() * gij**3
                alpha = gij**2 / denominator if denominator != 0 else 0.0
                weight = weight + alpha * max(float(gij), 0.0)
        total = total + weight * a[k]
    return torch.relu(total)


SLOW = {GradCAM: grad_cam, HiResCAM: hires_cam, LayerCAM: layer_cam, XGradCAM: xgrad_cam, GradCAMPlusPlus: grad_cam_pp}


@pytest.mark.parametrize("cam", list(SLOW))
def test_raw_maps_are_the_formula(setup, cam):
    model, x, acts, grads = setup
    got = cam(model, "features")(x, CLASSES, upsample=False, normalize=False)
    expected = torch.stack([SLOW[cam](acts[b], grads[b]) for b in range(2)])
    assert got.shape == (2, H, W)
    assert (expected > 0).any() and (expected == 0).any()  # the ReLU matters
    torch.testing.assert_close(got.double(), expected)


def test_normalised_maps_are_scaled_to_0_1_item_by_item(setup):
    model, x, acts, grads = setup
    got = GradCAM(model, "features")(x, CLASSES, upsample=False)
    raw = torch.stack([grad_cam(acts[b], grads[b]) for b in range(2)])
    low = raw.flatten(1).min(1).values[:, None, None]
    high = raw.flatten(1).max(1).values[:, None, None]
    torch.testing.assert_close(got.double(), (raw - low) / (high - low))


def test_upsampled_maps_are_bilinear_at_the_input_size(setup):
    """Input 6x15 (the layer is 3x5 after a stride-2 stem): the map is resized to 6x15, not 15x6."""
    model, _, _, _ = setup
    stem = nn.Sequential(nn.Conv2d(2, 2, 1, stride=(2, 3)), model).double().eval()
    x = torch.randn(2, 2, 6, 15, dtype=torch.float64)
    got = HiResCAM(stem, "1.features")(x, CLASSES, normalize=False)
    raw = HiResCAM(stem, "1.features")(x, CLASSES, upsample=False, normalize=False)
    expected = F.interpolate(raw[:, None], size=(6, 15), mode="bilinear", align_corners=False)[:, 0]
    assert got.shape == (2, 6, 15)
    torch.testing.assert_close(got, expected)


def test_eigen_cam_is_the_projection_on_the_top_singular_vector(setup):
    """Power iteration on ``O^T O`` (``O``: the ``(h*w, channels)`` activations, uncentred), sign: positive sum."""
    model, x, acts, _ = setup
    got = EigenCAM(model, "features")(x, upsample=False, normalize=False)
    for b in range(2):
        o = acts[b].reshape(K, H * W).T  # (h*w, K), rows in raster order
        v = torch.ones(K, dtype=torch.float64)
        for _ in range(500):
            v = o.T @ (o @ v)
            v = v / v.norm()
        projection = o @ v
        projection = projection if projection.sum() >= 0 else -projection
        torch.testing.assert_close(got[b].double(), torch.relu(projection).view(H, W), rtol=1e-6, atol=1e-8)


def test_score_cam_weights_are_the_class_probability_of_each_masked_input(setup):
    model, x, acts, _ = setup
    got = ScoreCAM(model, "features")(x, CLASSES, upsample=False, normalize=False)
    for b in range(2):
        total = torch.zeros(H, W, dtype=torch.float64)
        for k in range(K):
            a = acts[b, k]
            mask = (a - a.min()) / (a.max() - a.min())  # already at the input's size
            with torch.no_grad():
                probability = model(x[b : b + 1] * mask).softmax(dim=1)[0, CLASSES[b]]
            total = total + probability * a
        torch.testing.assert_close(got[b].double(), torch.relu(total))


class InPlaceResidual(nn.Module):
    """``h = embed(x)`` seen through a transpose (a view), then ``h += block(x)`` transposed: fine in plain PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Conv2d(2, K, 1), nn.Conv2d(2, K, 1), nn.Linear(K, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(2, 3)  # made before the layer: without autograd there, a view made in no_grad
        h += self.block(x).transpose(2, 3)
        return self.head(h.mean(dim=(2, 3)))


def test_in_place_residual_update_of_a_view_made_before_the_layer():
    torch.manual_seed(0)
    model = InPlaceResidual().double().eval()
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    model(x).sum().backward()  # the model itself runs and differentiates
    model.zero_grad(set_to_none=True)
    assert GradCAM(model, "block")(x, CLASSES).shape == (2, H, W)
