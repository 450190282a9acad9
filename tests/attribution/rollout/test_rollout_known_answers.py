"""Attention and gradient rollout against slow float64 re-implementations of the papers' formulas.

Attentions are random row-stochastic and asymmetric, so a product taken in the wrong order, a transposed step or the
wrong protected column of the discarding changes the numbers; three layers, so that the order of the middle one
shows too.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attribution import AttentionRollout, GradientRollout
from attribution.rollout import attention_rollout, discard_lowest, fuse_heads, gradient_rollout

B, HEADS, T = 2, 3, 5


def attentions(seed: int = 0, layers: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(B, HEADS, T, T, dtype=torch.float64).mul(2).softmax(-1) for _ in range(layers)]


def slow_fuse(a: torch.Tensor, fusion: str) -> torch.Tensor:
    out = torch.empty(B, T, T, dtype=torch.float64)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                values = [float(a[b, h, i, j]) for h in range(HEADS)]
                out[b, i, j] = {"mean": sum(values) / HEADS, "max": max(values), "min": min(values)}[fusion]
    return out


def slow_discard(fused: torch.Tensor, ratio: float) -> torch.Tensor:
    """Zero the ``floor(ratio T^2)`` lowest entries of each matrix (ties: in raster order), except in column 0."""
    out = fused.clone()
    count = math.floor(ratio * T * T)
    for b in range(B):
        entries = sorted(range(T * T), key=lambda p: (float(fused[b].flatten()[p]), p))[:count]
        for p in entries:
            if p % T != 0:
                out[b, p // T, p % T] = 0
    return out


def slow_rollout(atts: list[torch.Tensor], fusion: str = "mean", ratio: float = 0.0) -> torch.Tensor:
    rollout = torch.eye(T, dtype=torch.float64).expand(B, T, T)
    for a in atts:
        a_hat = 0.5 * slow_discard(slow_fuse(a, fusion), ratio) + 0.5 * torch.eye(T, dtype=torch.float64)
        a_hat = a_hat / a_hat.sum(-1, keepdim=True)
        rollout = a_hat @ rollout  # later layers on the left
    return rollout


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_rollout_is_the_product_of_the_residual_steps(fusion, ratio):
    atts = attentions()
    expected = slow_rollout(atts, fusion, ratio)
    torch.testing.assert_close(attention_rollout(atts, head_fusion=fusion, discard_ratio=ratio), expected)
    for row in [0, 3]:
        got = attention_rollout(atts, head_fusion=fusion, discard_ratio=ratio, row=row)
        torch.testing.assert_close(got, expected[:, row])


def test_fusion_of_heads():
    (a,) = attentions(layers=1)
    for fusion in ["mean", "max", "min"]:
        torch.testing.assert_close(fuse_heads(a, fusion), slow_fuse(a, fusion))


def test_discarding_keeps_column_0_and_breaks_ties_in_raster_order():
    """floor(0.3 * 25) = 7 lowest of: zeros in column 0 (kept), then ties at 0.1 taken row by row."""
    fused = torch.arange(1, 26, dtype=torch.float64).view(1, T, T).repeat(B, 1, 1)
    fused[:, :, 0] = 0.0  # the 5 lowest entries, all in column 0
    fused[:, 1:4, 2] = 0.1  # 3 tied entries next: (1, 2), (2, 2), (3, 2)
    fused[1] = fused[1].T.contiguous()  # item 1: the transpose, so row 0 is the low one
    got = discard_lowest(fused, 0.3)
    expected = slow_discard(fused, 0.3)
    torch.testing.assert_close(got, expected)
    assert got[0, :, 0].eq(0).all() and got[0, 1, 2] == 0 and got[0, 2, 2] == 0 and got[0, 3, 2] == 0.1
    assert (got[1, 0, 1:] == 0).all() and got[1, 2, 1] == 0 and got[1, 2, 3] == 0.1


def slow_gradient_rollout(atts: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """Chefer et al.: ``R = I``, then ``R = R + mean_h((g * A)^+) R`` layer by layer, first layer first."""
    rollout = torch.eye(T, dtype=torch.float64).expand(B, T, T)
    for a, g in zip(atts, grads, strict=True):
        weighted = sum(torch.clamp(g[:, h] * a[:, h], min=0) for h in range(HEADS)) / HEADS
        rollout = rollout + weighted @ rollout
    return rollout


def test_gradient_rollout_is_the_product_of_identity_plus_positive_weighted_attention():
    atts = attentions(1)
    torch.manual_seed(2)
    grads = [torch.randn_like(a) for a in atts]
    expected = slow_gradient_rollout(atts, grads)
    torch.testing.assert_close(gradient_rollout(atts, grads), expected)
    torch.testing.assert_close(gradient_rollout(atts, grads, row=0), expected[:, 0])


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.v = nn.Linear(d, d)
        self.probs = nn.Softmax(dim=-1)  # the hookable attention probabilities (batch, heads, T, T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k = self.qk(x).view(b, t, 2, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        attention = self.probs(q @ k.transpose(-1, -2) / math.sqrt(d // HEADS))
        v = self.v(x).view(b, t, HEADS, d // HEADS).transpose(1, 2)
        return x + (attention @ v).transpose(1, 2).reshape(b, t, d)


class TinyViT(nn.Module):
    """Three attention blocks over ``T`` tokens; the class token is token 0; a linear head on it."""

    num_prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(6) for _ in range(3))
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


@pytest.fixture
def vit():
    torch.manual_seed(3)
    return TinyViT().double().eval(), torch.randn(B, T, 6, dtype=torch.float64)


def captured(model: nn.Module, x: torch.Tensor, target: list[int] | None = None):
    """The attention probabilities of each block and, for ``target``, the gradient of its logits on them."""
    maps: list[torch.Tensor] = []

    def keep(module, args, output):
        output.retain_grad()
        maps.append(output)

    handles = [block.probs.register_forward_hook(keep) for block in model.blocks]
    try:
        with torch.enable_grad():
            logits = model(x)
            if target is not None:
                logits[torch.arange(B), target].sum().backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return [m.detach() for m in maps], [m.grad for m in maps] if target is not None else None


def test_attention_rollout_of_a_model_is_the_class_token_row_without_prefix(vit):
    model, x = vit
    maps, _ = captured(model, x)
    got = AttentionRollout(model, layers="blocks.*.probs", discard_ratio=0.2)(x)
    torch.testing.assert_close(got.double(), slow_rollout(maps, "mean", 0.2)[:, 0, 1:], rtol=1e-5, atol=1e-7)


def test_gradient_rollout_of_a_model_uses_each_items_class(vit):
    model, x = vit
    maps, grads = captured(model, x, [3, 1])
    got = GradientRollout(model, layers="blocks.*.probs")(x, [3, 1])
    torch.testing.assert_close(got.double(), slow_gradient_rollout(maps, grads)[:, 0, 1:], rtol=1e-5, atol=1e-7)
