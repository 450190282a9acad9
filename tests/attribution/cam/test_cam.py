"""Grad-CAM family: parity with references, paper re-implementations, state left intact, errors, faithfulness."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attribution import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from tests.attribution.models import gradcam_reference, small_vgg
from tests.support import hook_state

# The model runs in float64 against the float64 re-implementations, so the default float64 tolerances hold on any CPU
# (in float32, an XGrad-CAM channel whose activations sum to 2.7e-4 differs by 1.7e-4 relative on an AMD EPYC).
TOL: dict[str, float] = {}


# -- slow re-implementations from the papers (one image, float64, explicit loops) -------------------------------
def ref_gradcam(A, G):
    K, h, w = A.shape
    out = torch.zeros(h, w, dtype=torch.float64)
    for k in range(K):
        alpha = sum(G[k, i, j] for i in range(h) for j in range(w)) / (h * w)
        out += alpha * A[k]
    return out.clamp(min=0)


def ref_gradcam_pp(A, G):
    K, h, w = A.shape
    out = torch.zeros(h, w, dtype=torch.float64)
    for k in range(K):
        total = A[k].sum()
        weight = 0.0
        for i in range(h):
            for j in range(w):
                g = G[k, i, j]
                denominator = 2 * g**2 + total * g**3
                alpha = g**2 / denominator if denominator != 0 else 0.0
                weight += alpha * max(g, 0.0)
        out += weight * A[k]
    return out.clamp(min=0)


def ref_xgradcam(A, G):
    K, h, w = A.shape
    out = torch.zeros(h, w, dtype=torch.float64)
    for k in range(K):
        total = A[k].sum()
        weight = sum(A[k, i, j] / (total + 1e-12) * G[k, i, j] for i in range(h) for j in range(w))
        out += weight * A[k]
    return out.clamp(min=0)


def ref_hirescam(A, G):
    return sum(G[k] * A[k] for k in range(A.shape[0])).clamp(min=0)


def ref_layercam(A, G):
    return sum(G[k].clamp(min=0) * A[k] for k in range(A.shape[0])).clamp(min=0)


def ref_eigencam(A):
    """First principal direction by power iteration on O^T O (independent of the SVD used by the library)."""
    K, h, w = A.shape
    positions = A.reshape(K, h * w).T  # (positions, channels), uncentred
    v = torch.ones(K, dtype=torch.float64)
    for _ in range(500):
        v = positions.T @ (positions @ v)
        v = v / v.norm()
    projection = (positions @ v).reshape(h, w)
    if projection.sum() < 0:
        projection = -projection
    return projection.clamp(min=0)


REFERENCES = {
    GradCAM: ref_gradcam,
    GradCAMPlusPlus: ref_gradcam_pp,
    XGradCAM: ref_xgradcam,
    HiResCAM: ref_hirescam,
    LayerCAM: ref_layercam,
}


def vgg_acts_and_grads(model, x, targets):
    """A and dS/dA of the reference VGG's features.6, computed by hand (the in-place ReLU applied to a copy)."""
    A = model.features[:7](x).detach().requires_grad_(True)
    scores = model.classifier(F.relu(A))[torch.arange(len(targets)), targets]
    (G,) = torch.autograd.grad(scores.sum(), A)
    return A.detach().double(), G.double()


# -- parity ----------------------------------------------------------------------------------------------------
def test_gradcam_matches_captum_reference_with_inplace_relu_after_layer():
    model, ref = small_vgg(), gradcam_reference()
    cam = GradCAM(model, ref["layer"])
    x, targets = ref["input"], ref["targets"]
    torch.testing.assert_close(cam(x, targets.tolist(), upsample=False, normalize=False), ref["cam_layer_raw"])
    torch.testing.assert_close(cam(x, targets, upsample=False), ref["cam_layer_minmax"])
    torch.testing.assert_close(cam(x, targets), ref["cam_input_size"])


@pytest.mark.parametrize("method", list(REFERENCES), ids=lambda m: m.__name__)
def test_gradient_methods_match_paper_reimplementation(method):
    model, ref = small_vgg().double(), gradcam_reference()
    x, targets = ref["input"].double(), ref["targets"]
    A, G = vgg_acts_and_grads(model, x, targets)
    ours = method(model, "features.6")(x, targets, upsample=False, normalize=False)
    expected = torch.stack([REFERENCES[method](A[b], G[b]) for b in range(len(x))])
    assert expected.abs().max() > 0
    torch.testing.assert_close(ours.double(), expected, **TOL)


def test_eigencam_matches_power_iteration():
    model, ref = small_vgg().double(), gradcam_reference()
    x = ref["input"].double()
    A = model.features[:7](x).detach().double()
    ours = EigenCAM(model, "features.6")(x, upsample=False, normalize=False)
    expected = torch.stack([ref_eigencam(A[b]) for b in range(len(x))])
    torch.testing.assert_close(ours.double(), expected, **TOL)


def test_scorecam_matches_paper_reimplementation():
    model, ref = small_vgg().double(), gradcam_reference()
    x, targets = ref["input"][:2].double(), ref["targets"][:2].tolist()
    ours = ScoreCAM(model, "features.6", batch_size=7, progress=False)(x, targets, upsample=False, normalize=False)
    A = model.features[:7](x).detach()
    for b in range(2):
        expected = torch.zeros(8, 8, dtype=torch.float64)
        for k in range(A.shape[1]):
            up = F.interpolate(A[b, k][None, None], size=(32, 32), mode="bilinear", align_corners=False)[0, 0]
            mask = (up - up.min()) / (up.max() - up.min()) if up.max() > up.min() else torch.zeros_like(up)
            with torch.no_grad():
                p = model(x[b : b + 1] * mask).softmax(-1)[0, targets[b]]
            expected += p.double() * A[b, k].double()
        torch.testing.assert_close(ours[b].double(), expected.clamp(min=0), **TOL)


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.parametrize("arch", ["resnet50", "vgg11"])
def test_gradcam_equals_live_captum(arch):
    captum_attr = pytest.importorskip("captum.attr")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(weights=None).eval()
    layer = "layer4" if arch == "resnet50" else "features.18"  # vgg11's last conv, an in-place ReLU after it
    x = torch.randn(3, 3, 96, 96)
    targets = [1, 500, 999]
    theirs = captum_attr.LayerGradCam(model, model.get_submodule(layer)).attribute(
        x, target=targets, relu_attributions=True
    )[:, 0]
    ours = GradCAM(model, layer)(x, targets, upsample=False, normalize=False)
    assert theirs.abs().max() > 0
    theirs = theirs.detach()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


@pytest.mark.peers
def test_peers_read_the_post_relu_tensor_where_we_do_not():
    """pytorch-grad-cam and torchcam keep a reference to the layer's output, which the in-place ReLU overwrites."""
    model, ref = small_vgg(), gradcam_reference()
    x, targets = ref["input"], ref["targets"].tolist()
    exact = ref["cam_layer_minmax"]
    errors = {}
    try:
        from torchcam.methods import GradCAM as TorchCamGradCAM

        with TorchCamGradCAM(model, "features.6") as extractor:
            maps = extractor(class_idx=targets, scores=model(x))[0]
        errors["torchcam"] = float((maps - exact).abs().max())
    except ImportError:
        pass
    try:
        from pytorch_grad_cam import GradCAM as PGC
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        maps = PGC(model=model, target_layers=[model.features[6]])(
            input_tensor=x, targets=[ClassifierOutputTarget(t) for t in targets]
        )
        errors["pytorch-grad-cam"] = float((torch.as_tensor(maps) - ref["cam_input_size"]).abs().max())
    except ImportError:
        pass
    if not errors:
        pytest.skip("neither torchcam nor pytorch-grad-cam is installed")
    assert all(error > 0.05 for error in errors.values()), errors  # theirs is off; ours is exact (test above)


# -- semantics -------------------------------------------------------------------------------------------------
def test_output_shape_range_device_and_unbatched(tiny_cnn):
    x = torch.randn(3, 3, 20, 24)
    maps = GradCAM(tiny_cnn, "features.2")(x)
    assert maps.shape == (3, 20, 24) and maps.dtype == torch.float32 and maps.device == x.device
    assert float(maps.min()) >= 0 and float(maps.max()) <= 1
    assert torch.allclose(maps.flatten(1).amax(1), torch.ones(3))
    single = GradCAM(tiny_cnn, "features.2")(x[1])
    assert single.shape == (20, 24)
    torch.testing.assert_close(single, maps[1])
    assert GradCAM(tiny_cnn, "features.2")(x, upsample=False).shape == (3, 20, 24)  # padding keeps the size


def test_target_forms_agree(tiny_cnn):
    x = torch.randn(4, 3, 16, 16)
    top = tiny_cnn(x).argmax(1)
    cam = GradCAM(tiny_cnn, "features.2")
    by_none = cam(x, normalize=False)
    torch.testing.assert_close(cam(x, top.tolist(), normalize=False), by_none)
    torch.testing.assert_close(cam(x, top, normalize=False), by_none)
    torch.testing.assert_close(
        cam(x, lambda out: out.gather(1, out.argmax(1, keepdim=True))[:, 0], normalize=False), by_none
    )
    for c in range(5):
        torch.testing.assert_close(cam(x, c, normalize=False), cam(x, [c] * 4, normalize=False))


def test_callable_target_for_segmentation_output():
    torch.manual_seed(0)
    seg = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    x = torch.randn(2, 3, 16, 16)
    region = torch.zeros(16, 16, dtype=torch.bool)
    region[4:8, 4:8] = True
    maps = GradCAM(seg, "0")(x, target=lambda out: out[:, 1][:, region].sum(-1))
    assert maps.shape == (2, 16, 16)


def test_several_layers_give_each_map_and_the_documented_fusion(tiny_cnn):
    x = torch.randn(2, 3, 16, 16)
    cam = GradCAM(tiny_cnn, ["features.0", "features.2"])
    per_layer = cam.layer_maps(x, 1)
    assert list(per_layer) == ["features.0", "features.2"]
    torch.testing.assert_close(per_layer["features.2"], GradCAM(tiny_cnn, "features.2")(x, 1))
    stacked = torch.stack(list(per_layer.values())).mean(0)
    low = stacked.flatten(1).min(1).values[:, None, None]
    high = stacked.flatten(1).max(1).values[:, None, None]
    torch.testing.assert_close(cam(x, 1), (stacked - low) / (high - low))


def test_layer_called_twice_warns_and_call_chooses():
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True))
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.block(self.block(x)).mean((2, 3)))

    model = Twice().eval()
    x = torch.randn(2, 4, 8, 8)
    first = model.block[0](x).detach().requires_grad_(True)
    second = model.block[0](F.relu(first)).detach().requires_grad_(True)
    scores = model.head(F.relu(second).mean((2, 3)))[:, 2].sum()
    g2 = torch.autograd.grad(scores, second)[0]
    g1 = torch.autograd.grad(model.head(F.relu(model.block[0](F.relu(first))).mean((2, 3)))[:, 2].sum(), first)[0]
    with pytest.warns(UserWarning, match=r"ran 2 times in one forward; using its last call"):
        last = GradCAM(model, "block.0")(x, 2, upsample=False, normalize=False)
    torch.testing.assert_close(last, F.relu((g2.mean((2, 3), keepdim=True) * second).sum(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = GradCAM(model, "block.0", call=0)(x, 2, upsample=False, normalize=False)
    torch.testing.assert_close(chosen, F.relu((g1.mean((2, 3), keepdim=True) * first).sum(1)))
    with pytest.raises(ValueError, match=r"`call`=5, but `layer` 'block.0' ran 2 time"):
        GradCAM(model, "block.0", call=5)(x, 2)


def test_token_layers_become_grids():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).eval()
    x = torch.randn(2, 3, 224, 224)
    auto = GradCAM(vit, "blocks.11.norm1")(x, 3, upsample=False, normalize=False)
    assert auto.shape == (2, 14, 14)
    explicit = GradCAM(vit, "blocks.11.norm1", reshape=lambda t: t[:, 1:].reshape(2, 14, 14, -1).permute(0, 3, 1, 2))
    torch.testing.assert_close(auto, explicit(x, 3, upsample=False, normalize=False))
    assert GradCAM(vit, "blocks.11.norm1")(x, 3).shape == (2, 224, 224)


def test_channels_last_layer_with_einops_pattern():
    torch.manual_seed(0)

    class NHWC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 6, 4, stride=4)
            self.mix = nn.Linear(6, 6)
            self.head = nn.Linear(6, 4)

        def forward(self, x):
            h = self.mix(self.stem(x).permute(0, 2, 3, 1))  # (B, H, W, C), as Swin stages
            return self.head(h.mean((1, 2)))

    model = NHWC().eval()
    x = torch.randn(2, 3, 32, 32)
    maps = GradCAM(model, "mix", reshape="b h w c -> b c h w")(x, 1, upsample=False)
    assert maps.shape == (2, 8, 8)
    with pytest.raises(ValueError, match=r"not spatial|square"):
        GradCAM(model, "head")(x, 1)


# -- the model is left as it was ---------------------------------------------------------------------------------
def _snapshot(model):
    return {
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "hooks": hook_state(model),
        "grad_mode": torch.is_grad_enabled(),
    }


def _assert_same(before, after):
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]
    assert before["hooks"] == after["hooks"]
    assert before["grad_mode"] == after["grad_mode"]
    for a, b in zip(before["grads"], after["grads"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(before["buffers"], after["buffers"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", [GradCAM, GradCAMPlusPlus, LayerCAM, EigenCAM], ids=lambda m: m.__name__)
def test_model_left_exactly_as_found_in_train_mode_under_no_grad_with_frozen_params(resnet18, method):
    model = resnet18.train()
    model.layer1.eval()  # mixed flags must come back mixed
    for p in model.layer2.parameters():
        p.requires_grad_(False)
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.5)
    x = torch.randn(2, 3, 64, 64)
    reference = copy.deepcopy(model).eval()(x)
    before = _snapshot(model)
    with torch.no_grad():
        maps = method(model, "layer4")(x, [1, 2])
        assert not torch.is_grad_enabled()
    assert maps.shape == (2, 64, 64) and maps.max() > 0
    _assert_same(before, _snapshot(model))
    torch.testing.assert_close(model.eval()(x), reference)  # batch-norm statistics untouched


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_model_left_as_found_when_the_call_raises_or_is_interrupted(resnet18, error):
    model = resnet18.train()
    before = _snapshot(model)

    def target(out):
        raise error("stop")

    with pytest.raises(error):
        GradCAM(model, "layer4")(torch.randn(1, 3, 32, 32), target)
    _assert_same(before, _snapshot(model))


# -- bad input -------------------------------------------------------------------------------------------------
def test_errors_are_clear_and_leave_nothing_registered(resnet18):
    before = hook_state(resnet18)
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(KeyError, match=r"'layer5' is not a module of the model; did you mean 'layer.'"):
        GradCAM(resnet18, "layer5")
    with pytest.raises(ValueError, match=r"shape \(2, 1000\), which is not spatial"):
        GradCAM(resnet18, "fc")(x)
    with pytest.raises(ValueError, match=r"class 1000 is out of range: the model has 1000 classes"):
        GradCAM(resnet18, "layer4")(x, 1000)
    with pytest.raises(ValueError, match="has 3 entries but the batch has 2 items"):
        GradCAM(resnet18, "layer4")(x, [1, 2, 3])
    with pytest.raises(RuntimeError, match=r"the model failed on `inputs` of shape \(2, 4, 32, 32\)"):
        GradCAM(resnet18, "layer4")(torch.randn(2, 4, 32, 32))
    with pytest.raises(ValueError, match=r"`inputs` of shape \(32, 32\) \(torch.float32\) holds none: images are"):
        GradCAM(resnet18, "layer4")(torch.randn(32, 32))
    with pytest.raises(ValueError, match=r"callable `target` must return scores of shape \(2,\)"):
        GradCAM(resnet18, "layer4")(x, lambda out: out.sum())
    assert hook_state(resnet18) == before


# -- faithfulness ----------------------------------------------------------------------------------------------
def _shapes_dataset(n: int, generator: torch.Generator):
    """32x32 noise images with one shape at a random place: class 0 a red square, 1 a green cross, 2 a blue ring.

    Each class has its own colour, so each has evidence of its own where the shape is (with shapes alone, the
    network learns "cross" as "neither square nor ring", whose evidence is everywhere else).
    """
    images = 0.3 * torch.randn(n, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 3, (n,), generator=generator)
    boxes = torch.randint(0, 32 - 9, (n, 2), generator=generator)
    for i in range(n):
        r, c = boxes[i].tolist()
        patch = torch.zeros(9, 9)
        if labels[i] == 0:
            patch[1:8, 1:8] = 1
        elif labels[i] == 1:
            patch[4, :] = 1
            patch[:, 4] = 1
        else:
            patch[:, :] = 1
            patch[2:7, 2:7] = 0
        images[i, labels[i], r : r + 9, c : c + 9] += 2 * patch
    return images, labels, boxes


@pytest.mark.slow
def test_pointing_game_on_a_trained_cnn():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(120):
        x, y, _ = _shapes_dataset(64, generator)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    x, y, boxes = _shapes_dataset(200, generator)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean()
    maps = GradCAM(model, "5")(x, y)
    flat = maps.flatten(1).argmax(1)
    rows, cols = flat // 32, flat % 32
    inside = (rows >= boxes[:, 0]) & (rows < boxes[:, 0] + 9) & (cols >= boxes[:, 1]) & (cols < boxes[:, 1] + 9)
    assert accuracy > 0.9, accuracy
    assert inside.float().mean() >= 0.95, inside.float().mean()


def test_frozen_siamese_branches_each_get_gradients():
    torch.manual_seed(0)

    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            left, right = self.encoder(x), self.encoder(x.flip(-1))
            return self.head(torch.cat([left.mean((2, 3)), right.mean((2, 3))], 1))

    model = Siamese().eval().requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    first = GradCAM(model, "encoder.0", call=0)(x, 1, upsample=False, normalize=False)
    second = GradCAM(model, "encoder.0", call=1)(x, 1, upsample=False, normalize=False)
    acts = [model.encoder[0](x), model.encoder[0](x.flip(-1))]
    weights = model.head.weight[1].view(2, 4)  # d score / d mean(relu(a)) per branch and channel
    for branch, ours in enumerate([first, second]):
        a = acts[branch]
        g = weights[branch][None, :, None, None] * (a > 0).float() / 64
        torch.testing.assert_close(ours, F.relu((g.mean((2, 3), keepdim=True) * a).sum(1)))


def test_layercam_fuses_layers_as_the_paper(tiny_cnn):
    x = torch.randn(2, 3, 16, 16)
    cam = LayerCAM(tiny_cnn, ["features.0", "features.2"])
    raw = cam.layer_maps(x, 2, normalize=False)
    scaled = [torch.tanh(2 * m / m.flatten(1).amax(1).view(-1, 1, 1)) for m in raw.values()]
    fused = torch.stack(scaled).amax(0)
    low, high = fused.flatten(1).amin(1).view(-1, 1, 1), fused.flatten(1).amax(1).view(-1, 1, 1)
    torch.testing.assert_close(cam(x, 2), (fused - low) / (high - low))
