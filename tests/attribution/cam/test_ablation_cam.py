"""Ablation-CAM: the closed form on a linear head, a slow per-channel re-run, pytorch-grad-cam, the model's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import AblationCAM
from tests.support import hook_state

F64 = torch.float64


def linear_head_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)
    ).double()


def test_weights_on_a_linear_head_are_in_closed_form():
    # y = sum_k v_k mean(A_k) + c, so y - y_k = v_k mean(A_k): w_k = v_k mean(A_k) / y
    model = linear_head_cnn()
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    acts = model[1](model[0](x)).detach()
    v, c = model[4].weight[2].detach(), model[4].bias[2].detach()
    y = acts.mean((2, 3)) @ v + c
    w = v * acts.mean((2, 3)) / y[:, None]
    expected = torch.relu((w[:, :, None, None] * acts).sum(1))
    ours = AblationCAM(model, "1", batch_size=4, progress=False)(x, target=2, upsample=False, normalize=False)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


def slow_ablation_cam(model: nn.Module, layer: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    """The definition, one full forward per channel with the channel zeroed by a hook."""
    seen = []
    handle = layer.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        y = model(x)[:, target]
    handle.remove()
    acts = seen[0]
    weights = torch.empty(acts.shape[:2], dtype=acts.dtype)
    for k in range(acts.shape[1]):

        def zero(m, a, out, k=k):
            out = out.clone()
            out[:, k] = 0
            return out

        handle = layer.register_forward_hook(zero)
        with torch.no_grad():
            weights[:, k] = (y - model(x)[:, target]) / y
        handle.remove()
    return torch.relu((weights[:, :, None, None] * acts).sum(1))


class Residual(nn.Module):
    """Stem -> a residual block whose second conv is the layer (the shortcut is added after it) -> pool -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        out = torch.relu(self.conv2(torch.relu(self.conv1(h))) + h)
        return self.fc(out.mean((2, 3)))


def test_a_layer_inside_a_residual_block_matches_the_slow_definition():
    torch.manual_seed(1)
    model = Residual().double().eval()
    x = torch.randn(2, 3, 10, 10, dtype=F64)
    expected = slow_ablation_cam(model, model.conv2, x, 3)  # the shortcut h (batch 1) broadcasts over the copies
    ours = AblationCAM(model, "conv2", batch_size=4, progress=False)(x, 3, upsample=False, normalize=False)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


class Twice(nn.Module):
    """The same conv applied twice: ``call=0`` ablates the first application, ``call=1`` the second."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv, self.fc = nn.Conv2d(3, 5, 3, padding=1), nn.Conv2d(5, 5, 3, padding=1), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(torch.tanh(self.conv(self.stem(x)))))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("call", [0, 1])
def test_a_layer_called_twice_ablates_the_chosen_call(call):
    torch.manual_seed(2)
    model = Twice().double().eval()
    x = torch.randn(2, 3, 6, 9, dtype=F64)  # non-square
    seen: list[torch.Tensor] = []
    handle = model.conv.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        y = model(x)[:, 1]
    handle.remove()
    acts, weights = seen[call], torch.empty(2, 5, dtype=F64)
    for k in range(5):
        count = [0]

        def zero(m, a, out, k=k, count=count):
            count[0] += 1
            if count[0] - 1 != call:
                return None
            out = out.clone()
            out[:, k] = 0
            return out

        handle = model.conv.register_forward_hook(zero)
        with torch.no_grad():
            weights[:, k] = (y - model(x)[:, 1]) / y
        handle.remove()
    expected = torch.relu((weights[:, :, None, None] * acts).sum(1))
    ours = AblationCAM(model, "conv", call=call, batch_size=2, progress=False)(x, 1, upsample=False, normalize=False)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.peers
@pytest.mark.slow  # importing pytorch-grad-cam takes about 4 s
def test_matches_pytorch_grad_cam():
    pgc = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 12, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(48, 5),
    ).eval()
    x = torch.randn(3, 3, 16, 16)
    theirs = pgc.AblationCAM(model=model, target_layers=[model[3]], batch_size=5)(
        input_tensor=x, targets=[ClassifierOutputTarget(t) for t in (1, 3, 0)]
    )
    ours = AblationCAM(model, "3", batch_size=5, progress=False)(x, target=[1, 3, 0])
    torch.testing.assert_close(ours, torch.as_tensor(theirs), rtol=0, atol=1e-5)  # float32 maps in [0, 1]


def test_the_model_is_left_as_found_also_on_errors():
    model = linear_head_cnn().train()
    model[4].weight.grad = torch.ones_like(model[4].weight)
    before = (hook_state(model), [m.training for m in model.modules()], model[4].weight.grad)
    AblationCAM(model, "1", progress=False)(torch.randn(1, 3, 8, 8, dtype=F64), target=0)
    with pytest.raises(TypeError, match="image tensor"):
        AblationCAM(model, "1", progress=False)((torch.randn(1, 3, 8, 8),), target=0)
    with pytest.raises(ValueError, match=r"\(batch, channels, h, w\)"):
        AblationCAM(model, "3", progress=False)(torch.randn(1, 3, 8, 8, dtype=F64), target=0, upsample=False)
    assert (hook_state(model), [m.training for m in model.modules()], model[4].weight.grad) == before


def test_uint8_images_get_the_conversion_error():
    with pytest.raises(TypeError, match=r"images.float\(\) / 255"):
        AblationCAM(linear_head_cnn(), "1", progress=False)(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))
