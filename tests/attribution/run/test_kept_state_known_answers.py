"""Every call gives each parameter back the ``.grad`` it had: the same tensor object, or ``None``.

The model's forward itself writes ``.grad`` (as code that accumulates or zeroes gradients inside a forward would),
so the restore is what puts it back, whatever the method does on its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import GradCAM, activation_patching, attribution_patching
from attribution.metrics import deletion


class GradWriter(nn.Module):
    """A small CNN whose forward sets ``.grad`` of its first convolution's weight and drops that of its bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.conv.weight.grad = torch.full_like(self.conv.weight, 7.0)
        self.conv.bias.grad = None
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def calls(model: nn.Module, x: torch.Tensor):
    return {
        "GradCAM": lambda: GradCAM(model, "conv")(x, [0, 3]),
        "deletion": lambda: deletion(model, x, torch.rand(2, 5, 6), [0, 3], steps=3),
        "activation_patching": lambda: activation_patching(
            model, x, x.flip(0), "conv", lambda out: out[:, 0].sum(), positions=False, progress=False
        ),
        "attribution_patching": lambda: attribution_patching(
            model, x, x.flip(0), "conv", lambda out: out[:, 0].sum(), positions=False, progress=False
        ),
    }


@pytest.mark.parametrize("method", ["GradCAM", "deletion", "activation_patching", "attribution_patching"])
def test_grad_tensors_and_nones_come_back(method):
    torch.manual_seed(0)
    model = GradWriter().train()
    model.head.train(False)  # mixed flags come back as they were
    model.head.bias.requires_grad_(False)  # a frozen parameter stays frozen, the others keep requiring grad
    x = torch.randn(2, 2, 5, 6)
    kept = torch.full_like(model.conv.bias, -1.0)
    model.conv.bias.grad = kept  # a tensor the forward drops
    assert model.conv.weight.grad is None  # None, and the forward writes one
    model.head.weight.grad = torch.ones_like(model.head.weight)
    head_grad = model.head.weight.grad
    calls(model, x)[method]()
    assert model.conv.weight.grad is None
    assert model.conv.bias.grad is kept
    assert torch.equal(kept, torch.full_like(kept, -1.0))
    assert model.head.weight.grad is head_grad
    assert torch.equal(head_grad, torch.ones_like(head_grad))
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False]
    assert [m.training for m in model.modules()] == [True, True, False]


def test_grad_comes_back_when_the_call_raises():
    torch.manual_seed(0)
    model = GradWriter().eval()
    kept = torch.zeros_like(model.conv.bias)
    model.conv.bias.grad = kept

    def failing(out: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        GradCAM(model, "conv")(torch.randn(2, 2, 5, 6), failing)
    assert model.conv.bias.grad is kept
    assert model.conv.weight.grad is None


def test_calls_run_in_eval_mode_even_when_only_some_modules_train():
    """Dropout in training mode would make the map random: the call runs the whole model in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Dropout(0.5), nn.Flatten(), nn.Linear(3 * 5 * 6, 4))
    x = torch.randn(2, 2, 5, 6)
    model.eval()
    expected = GradCAM(model, "1")(x, [0, 3])
    model.train()
    model[3].train(False)  # some modules in training mode, some not
    got = GradCAM(model, "1")(x, [0, 3])
    torch.testing.assert_close(got, expected)
    assert [m.training for m in model.modules()] == [True, True, True, True, False]
