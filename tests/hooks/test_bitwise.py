"""Observing gradients changes no gradient, to the last bit: autograd sums each tensor's gradients as it would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import Recorder
from tests.attribution.models import tiny_llama

GRADS = ("grad_input", "grad_output")


class RMSNorm(nn.Module):
    """Llama's RMSNorm: its input is used twice inside (square, scale), and by the residual stream outside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mix = RMSNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.norm(x))


def _gradients(model: nn.Module, run, capture: tuple[str, ...] | None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    if capture is None:
        out = run()
    else:
        with Recorder(model, "**", capture=capture):
            out = run()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_bitwise(model: nn.Module, run, capture: tuple[str, ...]) -> None:
    out_ref, ref = _gradients(model, run, None)
    out, got = _gradients(model, run, capture)
    assert torch.equal(out, out_ref)
    differ = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not differ, f"observing with capture={capture} changed the gradients of {differ}"


@pytest.mark.parametrize("capture", [GRADS, ("grad_output",), ("grad_input",)])
def test_a_norm_whose_input_is_used_three_times_keeps_bitwise_gradients(capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), *[Residual(16) for _ in range(3)], nn.Linear(16, 3))
    x = torch.randn(4, 7, 16)

    def run() -> torch.Tensor:
        out = model(x)
        out.pow(2).sum().backward()
        return out

    _assert_bitwise(model, run, capture)


@pytest.mark.parametrize("capture", [GRADS, ("grad_output",)])
def test_a_tiny_llama_keeps_bitwise_gradients_under_a_recorder_of_every_module(capture):
    model = tiny_llama()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))

    def run() -> torch.Tensor:
        out = model(ids).logits
        out.pow(2).sum().backward()
        return out

    _assert_bitwise(model, run, capture)


def test_the_recorded_input_gradient_is_the_gradient_through_the_call_only():
    torch.manual_seed(0)
    block = Residual(6).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    with Recorder(block, "norm", capture=GRADS) as rec:
        block(x).sum().backward()
    # through the norm only: the slow way, a fresh graph from x to the norm's output with the recorded grad_output
    xr = x.detach().requires_grad_(True)
    (expected,) = torch.autograd.grad(block.norm(xr), xr, rec["norm"].grad_output)
    torch.testing.assert_close(rec["norm"].grad_input, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(rec["norm"].grad_input, x.grad)  # x.grad also holds the residual's share
