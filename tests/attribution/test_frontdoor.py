"""One front door: every input form, every target form, honest warnings, compiled and checkpointed models."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from attribution import AttentionRollout, GradCAM, GradientRollout, patch, record, targets
from tests.attribution.models import tiny_llama
from tests.conftest import TinyCNN, hook_state


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def hand_gradcam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    return F.relu((grads.mean((2, 3), keepdim=True) * acts).sum(1))


# -- inputs ------------------------------------------------------------------------------------------------------
class Keyword(nn.Module):
    """A CNN that takes its image by keyword, as HuggingFace vision models take ``pixel_values``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyCNN()

    def forward(self, pixel_values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.net(pixel_values * scale)


def test_cams_take_tensors_tuples_dicts_mappings_and_single_images(no_warnings):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Keyword().eval()
    x = torch.randn(3, 3, 12, 12)
    expected = GradCAM(model, "net.features.2")(x, 1)
    cam = GradCAM(model, "net.features.2")
    torch.testing.assert_close(cam((x, 1.0), 1), expected)
    torch.testing.assert_close(cam({"pixel_values": x}, 1), expected)
    feature = transformers.BatchFeature({"pixel_values": x})  # what image processors return: a Mapping, not a dict
    torch.testing.assert_close(cam(feature, 1), expected)
    torch.testing.assert_close(cam({"pixel_values": x[2]}, 1), expected[2])
    torch.testing.assert_close(cam(x[2], 1), expected[2])


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


def test_rollout_takes_a_single_image_and_a_batch_feature():
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=2, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    batch = AttentionRollout(vit)(x)
    assert batch.shape == (2, 4, 4)
    torch.testing.assert_close(AttentionRollout(vit)(x[1]), batch[1])
    torch.testing.assert_close(GradientRollout(vit)(x[1], 3), GradientRollout(vit)(x, 3)[1])
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    hf = transformers.ViTForImageClassification(config).eval()
    pixels = torch.randn(2, 3, 32, 32)
    feature = transformers.BatchFeature({"pixel_values": pixels})
    torch.testing.assert_close(AttentionRollout(hf)(feature), AttentionRollout(hf)({"pixel_values": pixels}))
    torch.testing.assert_close(AttentionRollout(hf)(pixels[0]), AttentionRollout(hf)(pixels)[0])


# -- targets -----------------------------------------------------------------------------------------------------
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


# -- no silent garbage -------------------------------------------------------------------------------------------
def test_vit_layer_after_the_last_token_mixing_warns_and_names_earlier_layers():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=3, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.warns(UserWarning, match=r"zero for items \[0, 1\].*e.g. 'blocks.1' or 'blocks.2.norm1'") as seen:
        maps = GradCAM(vit, "blocks.2")(x, 1)
    assert seen[0].filename == __file__  # attributed to the caller's line
    assert torch.equal(maps, torch.zeros_like(maps))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in ("blocks.1", "blocks.2.norm1"):
            assert GradCAM(vit, layer)(x, 1).amax() > 0


def test_channels_last_output_and_one_cell_grid_warn(tiny_cnn):
    torch.manual_seed(0)

    class NHWC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 6, 4, stride=4)
            self.mix = nn.Linear(6, 24)
            self.head = nn.Linear(24, 4)

        def forward(self, x):
            return self.head(self.mix(self.stem(x).permute(0, 2, 3, 1)).mean((1, 2)))  # (B, H, W, C), as Swin

    model = NHWC().eval()
    x = torch.randn(2, 3, 32, 64)  # a wide image: an 8 x 16 grid
    with pytest.warns(UserWarning, match=r"\(2, 8, 16, 24\), which looks channels-last.*reshape='b h w c -> b c h w'"):
        GradCAM(model, "mix")(x, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradCAM(model, "mix", reshape="b h w c -> b c h w")(x, 1)
        GradCAM(tiny_cnn, "features.0")(torch.randn(2, 3, 4, 4), 1)  # (2, 8, 4, 4): channels-first, no warning
    with pytest.warns(UserWarning, match=r"1x1 grid.*'layer4' rather than 'avgpool'"):
        GradCAM(tiny_cnn, "pool")(torch.randn(2, 3, 8, 8), 1)


# -- compiled and checkpointed models ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_cams_on_compiled_models_that_already_ran_equal_the_uncompiled_maps(resnet18, how):
    torch._dynamo.reset()
    x = torch.randn(2, 3, 64, 64)
    expected = GradCAM(resnet18, "layer4")(x, [1, 2])
    if how == "torch.compile":
        compiled = torch.compile(resnet18, backend="eager")
    else:
        resnet18.compile(backend="eager")
        compiled = resnet18
    with torch.no_grad():
        compiled(x)  # compiled and run before our hooks exist: the compiled code does not see hooks added later
    before = hook_state(resnet18)
    torch.testing.assert_close(GradCAM(compiled, "layer4")(x, [1, 2]), expected)
    with record(compiled, "layer4") as acts, torch.no_grad():
        compiled(x)
    assert hook_state(resnet18) == before
    if how == "module.compile":
        assert resnet18._compiled_call_impl is not None  # still compiled afterwards
    assert acts["layer4"].shape == (2, 512, 2, 2)  # record runs compiled code eagerly too, so its hooks fire
    torch._dynamo.reset()


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x)
        x = self.body(x) if self.reentrant is None else checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.head(x.mean((2, 3)))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("layer", ["stem", "body.0", "body.2"])
def test_checkpointing_gives_the_same_maps_or_names_the_cause(layer):
    torch.manual_seed(0)
    plain = Checkpointed(None).eval()
    x = torch.randn(2, 3, 8, 8)
    expected = GradCAM(plain, layer)(x, 1, normalize=False)
    model = Checkpointed(False).eval()
    model.load_state_dict(plain.state_dict())
    torch.testing.assert_close(GradCAM(model, layer)(x, 1, normalize=False), expected)
    model.reentrant = True
    before = hook_state(model)
    with pytest.raises(ValueError, match=r"checkpoint\(use_reentrant=True\).*Use use_reentrant=False"):
        GradCAM(model, layer)(x, 1)
    assert hook_state(model) == before


# -- sites ---------------------------------------------------------------------------------------------------------
def test_input_site_reaches_keyword_only_arguments_and_can_name_them():
    model = tiny_llama(hidden_size=16, intermediate_size=32, num_attention_heads=2, max_position_embeddings=32)
    tokens = torch.randint(0, 50, (2, 5))
    site = "model.layers.0.self_attn"  # called as self_attn(hidden_states=..., ...): no positional argument
    with (
        record(model, site, site="input") as first,
        record(model, site, site="input", element="hidden_states") as named,
        record(model, "model.layers.0.input_layernorm") as norm,
        torch.no_grad(),
    ):
        logits = model(tokens).logits
    assert torch.equal(first[site], norm["model.layers.0.input_layernorm"])
    assert torch.equal(named[site], first[site])
    with patch(model, {site: torch.zeros(2, 5, 16)}, site="input"), torch.no_grad():
        patched = model(tokens).logits
    assert not torch.allclose(patched, logits)
    with pytest.raises(ValueError, match=r"`element`='states', but 'model.layers.0.self_attn' was called without"):
        with record(model, site, site="input", element="states"), torch.no_grad():
            model(tokens)


def test_record_and_patch_read_model_output_elements_by_index_and_name():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    bert = transformers.BertModel(config, add_pooling_layer=False).eval()
    tokens = torch.randint(0, 50, (2, 6))
    with (
        record(bert, "encoder", element="last_hidden_state") as by_name,
        record(bert, "encoder", element=0) as by_index,
        torch.no_grad(),
    ):
        out = bert(tokens)
    assert torch.equal(by_name["encoder"], out.last_hidden_state)
    assert torch.equal(by_index["encoder"], out.last_hidden_state)
    with patch(bert, {"encoder": targets_zero(element="last_hidden_state")}), torch.no_grad():
        patched = bert(tokens)
    assert type(patched.last_hidden_state) is torch.Tensor and torch.equal(
        patched.last_hidden_state, torch.zeros(2, 6, 16)
    )


def targets_zero(element):
    from attribution import Patch

    return Patch(lambda a: a * 0, element=element)


def test_threads_all_records_and_patches_forwards_of_other_threads(tiny_cnn):
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        clean = tiny_cnn(x)
    with ThreadPoolExecutor(1) as pool:
        with record(tiny_cnn, "features.2") as mine, torch.no_grad():
            pool.submit(tiny_cnn, x).result()
        assert "features.2" not in mine  # "current": the worker's forward is not this thread's
        with record(tiny_cnn, "features.2", threads="all") as everyone, torch.no_grad():
            pool.submit(tiny_cnn, x).result()
        assert everyone["features.2"].shape == (2, 16, 8, 8)
        with patch(tiny_cnn, {"features.3": lambda a: a * 0}, threads="all"), torch.no_grad():
            out = pool.submit(tiny_cnn, x).result()
        torch.testing.assert_close(out, tiny_cnn.fc.bias.expand(2, -1))
        with torch.no_grad():
            torch.testing.assert_close(pool.submit(tiny_cnn, x).result(), clean)
    assert threading.active_count() >= 1


# -- bugs the suite let through --------------------------------------------------------------------------------
def test_record_keeps_a_copy_that_later_in_place_operations_cannot_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = model[0](x).detach()
    assert (expected < 0).any()  # the in-place ReLU would zero these in a shared tensor
    with record(model, "0") as out, record(model, "1", site="input") as inp, torch.no_grad():
        model(x)
    assert torch.equal(out["0"], expected)
    assert torch.equal(inp["1"], expected)


def test_cam_keeps_no_graph_of_the_backbone(resnet18):
    """The lean claim: autograd is off before the layer, and only the head's tensors are saved for backward."""
    seen = {}
    handles = [
        resnet18.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, (torch.is_grad_enabled(), o.requires_grad))
        )
        for name in ("conv1", "layer3", "fc")
    ]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            GradCAM(resnet18, "layer4")(torch.randn(2, 3, 64, 64), 1)
    finally:
        for h in handles:
            h.remove()
    assert seen == {"conv1": (False, False), "layer3": (False, False), "fc": (True, True)}
    # avgpool and fc: a handful of small tensors; the backbone's graph would save hundreds (convs, batch norms)
    assert len(saved) < 10 and sum(saved) < 2 * 512 * 2 * 2 + 1000 * 512 + 10_000, (len(saved), sum(saved))


class ViewBlock(nn.Module):
    """Returns a view of its input (a transpose), after which the parent changes that input in place."""

    def forward(self, x):
        return x.transpose(2, 3)


class ViewNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.view = ViewBlock()
        self.flat = nn.Flatten()
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = self.conv(x)
        v = self.view(h)
        out = self.head(self.flat(F.relu(v)))
        h.mul_(0)  # in place on the tensor the view shares storage with: the layer's output must not change
        return out


def test_view_returning_layers_with_backward_hooks_through_the_cam_path():
    hooks = pytest.importorskip("hooks")
    torch.manual_seed(0)
    model = ViewNet().eval()
    x = torch.randn(2, 3, 6, 6)
    acts = model.conv(x).transpose(2, 3).detach().requires_grad_(True)
    score = model.head(model.flat(F.relu(acts)))[:, 1].sum()
    expected = hand_gradcam(acts.detach(), torch.autograd.grad(score, acts, retain_graph=True)[0])
    grads_seen = []
    with hooks.HookManager(model) as mgr:  # the user's own backward hooks on view-returning modules stay intact
        mgr.group("user").backward(["view", "flat"], lambda m, gi, go, *, name: grads_seen.append((name, go[0])))
        maps = GradCAM(model, "view")(x, 1, upsample=False, normalize=False)
        grads_seen.clear()  # ours goes through the user's hook on `flat` (downstream of the layer): it observes
        out = model(x)
        out[:, 1].sum().backward()
    torch.testing.assert_close(maps, expected)
    assert [name for name, _ in grads_seen] == ["flat", "view"]
    torch.testing.assert_close(grads_seen[1][1], torch.autograd.grad(score, acts)[0])
    model.zero_grad(set_to_none=True)
    relu = F.relu(acts).detach().requires_grad_(True)
    g = torch.autograd.grad(model.head(relu.flatten(1))[:, 1].sum(), relu)[0]
    flat_maps = GradCAM(model, "flat", reshape=lambda t: t.view(-1, 4, 6, 6))(x, 1, upsample=False, normalize=False)
    torch.testing.assert_close(flat_maps, hand_gradcam(relu.detach(), g))
