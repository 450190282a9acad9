"""DeepLift's rules beyond Rescale: norms with the scale frozen, softmax per item, HF activations, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import DeepLift

F64 = torch.float64


class GemmaRMSNorm(nn.Module):
    """An RMSNorm of another library, gain ``1 + weight`` (Gemma's convention)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.3)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def frozen_layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    std = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt().detach()
    return (x - mean) / std * norm.weight + norm.bias


def frozen_rms_norm(gain: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach() * gain


@pytest.mark.parametrize("kind", ["layer", "rms", "gemma"])
def test_norms_take_the_gradient_with_the_scale_frozen(kind):
    torch.manual_seed(0)
    norm = {"layer": nn.LayerNorm(6), "rms": nn.RMSNorm(6, eps=1e-5), "gemma": GemmaRMSNorm(6)}[kind]
    with torch.no_grad():
        norm.weight.normal_()
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 3)).double()
    x, b = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    leaf = x.clone().requires_grad_(True)
    h = model[0](leaf)
    if kind == "layer":
        normed = frozen_layer_norm(norm, h)
    else:
        gain = norm.weight if kind == "rms" else 1 + norm.weight
        normed = frozen_rms_norm(gain, 1e-5 if kind == "rms" else 1e-6, h)
    (grad,) = torch.autograd.grad(model[2](normed)[:, 2].sum(), leaf)
    result = DeepLift(model, b)(x, target=2, return_delta=True)
    torch.testing.assert_close(result.attributions, (x - b) * grad, rtol=1e-10, atol=1e-13)
    gain = model(x)[:, 2] - model(b)[:, 2]
    torch.testing.assert_close(result.delta, result.attributions.sum(1) - gain.detach(), rtol=0, atol=1e-12)


def test_softmax_rule_normalises_each_item_on_its_own():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.Softmax(dim=1)).double()
    x, b = torch.randn(3, 4, dtype=F64), torch.zeros(1, 4, dtype=F64)
    together = DeepLift(model, b)(x, target=1)
    alone = torch.cat([DeepLift(model, b)(x[i : i + 1], target=1) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-15)


def test_huggingface_activation_modules_get_the_rescale_rule():
    activations = pytest.importorskip("transformers.activations")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), activations.NewGELUActivation(), nn.Linear(8, 2)).double()
    x = torch.randn(3, 4, dtype=F64)
    result = DeepLift(model)(x, target=0, return_delta=True)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)  # exact: Rescale ran


def test_modules_without_a_rule_are_refused_by_name():
    module = nn.Sequential(nn.Conv2d(2, 2, 1), nn.AdaptiveMaxPool2d(1), nn.Flatten())
    with pytest.raises(ValueError, match="AdaptiveMaxPool2d") as info:
        DeepLift(module)(torch.randn(2, 2, 3, 3), target=0)
    assert "GradientShap" in str(info.value)


def test_a_module_called_on_a_non_batch_first_tensor_is_refused():
    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.act = nn.Linear(3, 3), nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.lin(x).transpose(0, 1)).transpose(0, 1).sum(1)

    with pytest.raises(ValueError, match="not batch-first"):
        DeepLift(SeqFirst())(torch.randn(2, 5, 3), target=0)
