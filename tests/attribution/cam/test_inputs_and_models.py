"""Every input form, honest warnings, compiled and checkpointed models, no graph kept of the backbone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from attribution import GradCAM, record
from tests.support import TinyCNN, hook_state


def hand_gradcam(acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    return F.relu((grads.mean((2, 3), keepdim=True) * acts).sum(1))


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


def test_vit_layer_after_the_last_token_mixing_warns_and_names_earlier_layers():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=3, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.warns(UserWarning, match=r"zero for items \[0, 1\].*e.g. 'blocks.2.norm1' or 'blocks.1.mlp'") as seen:
        maps = GradCAM(vit, "blocks.2")(x, 1)
    assert seen[0].filename == __file__  # attributed to the caller's line
    assert torch.equal(maps, torch.zeros_like(maps))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in ("blocks.2.norm1", "blocks.1.mlp"):
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


def test_cam_keeps_no_graph_of_the_backbone(resnet18):
    """The lean claim: nothing requires grad before the layer, and only the head's tensors are saved for backward."""
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
    assert seen == {"conv1": (True, False), "layer3": (True, False), "fc": (True, True)}
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
