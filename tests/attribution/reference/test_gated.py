"""DeepLIFT through a gated MLP, ``down(act(gate(x)) * up(x))``: the average rule on the product, by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import DeepLift, DeepLiftShap

F64 = torch.float64


class GatedMLP(nn.Module):
    def __init__(self, width: int = 4, hidden: int = 6, out: int = 3, scale: float = 1.0) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down_proj, self.act_fn, self.scale = nn.Linear(hidden, out), nn.SiLU(), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * self.scale)


class Net(nn.Module):
    """An input projection, then the gated MLP (called ``mlp``, as in HuggingFace's layers)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.inp, self.mlp = nn.Linear(5, 4), GatedMLP(scale=scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.inp(x))


def _slow_deeplift(net: Net, x: torch.Tensor, ref: torch.Tensor, target: int) -> torch.Tensor:
    """The paper's rules written out: Rescale on SiLU, average on the product, linear layers' weights."""
    mlp = net.mlp
    z, z_r = net.inp(x), net.inp(ref)
    g, g_r = mlp.gate_proj(z), mlp.gate_proj(z_r)
    a, a_r, b, b_r = torch.nn.functional.silu(g), torch.nn.functional.silu(g_r), mlp.up_proj(z), mlp.up_proj(z_r)
    c = mlp.down_proj.weight[target]  # the target's multiplier at the product, per hidden unit
    m_silu = (a - a_r) / (g - g_r)
    grad_g = c * (b + b_r) / 2 * m_silu
    grad_b = c * (a + a_r) / 2
    grad_z = grad_g @ mlp.gate_proj.weight + grad_b @ mlp.up_proj.weight
    return (x - ref) * (grad_z @ net.inp.weight)


def test_deeplift_through_a_gated_mlp_is_the_average_rule_by_hand():
    torch.manual_seed(0)
    net = Net().double()
    x, ref = torch.randn(3, 5, dtype=F64), torch.randn(1, 5, dtype=F64)
    result = DeepLift(net, baseline=ref)(x, target=2, return_delta=True)
    with torch.no_grad():
        expected = _slow_deeplift(net, x, ref.expand_as(x), 2)
    torch.testing.assert_close(result.attributions, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.delta, torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)  # sums exactly


def test_deepliftshap_through_a_gated_mlp_sums_to_the_mean_difference():
    torch.manual_seed(1)
    net = Net().double()
    x, refs = torch.randn(2, 5, dtype=F64), torch.randn(4, 5, dtype=F64)
    result = DeepLiftShap(net, refs)(x, target=0, return_delta=True)
    assert result.delta.abs().max() < 1e-12


def test_a_gated_mlp_that_is_not_act_times_up_is_refused():
    torch.manual_seed(2)
    net = Net(scale=2.0).double()  # the down projection reads 2 * act * up
    with pytest.raises(ValueError, match=r"not the product of 'mlp\.act_fn'"):
        DeepLift(net)(torch.randn(2, 5, dtype=F64), target=0)


def test_a_gated_mlp_without_an_activation_module_is_refused_by_name():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    with pytest.raises(ValueError, match="no activation module") as info:
        DeepLift(Functional())(torch.randn(2, 4), target=0)
    assert "GradientShap" in str(info.value)


def test_deeplift_runs_on_a_llama_through_its_embeddings_and_leaves_it_as_found():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(3)
    llama = transformers.LlamaForCausalLM(config).double().eval()

    class LastLogits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = llama

        def forward(self, embeds: torch.Tensor) -> torch.Tensor:
            return self.lm(inputs_embeds=embeds).logits[:, -1]

    net = LastLogits()
    embeds = llama.get_input_embeddings()(torch.tensor([[1, 5, 7, 2], [3, 3, 9, 4]])).detach()
    before = net(embeds)
    result = DeepLift(net)(embeds, target=6, return_delta=True)
    assert result.attributions.shape == embeds.shape and torch.isfinite(result.attributions).all()
    # the norms' frozen scale and the functional softmax leave a delta; it stays a fraction of the difference
    gain = before[:, 6] - net(torch.zeros_like(embeds))[:, 6]
    assert (result.delta.abs() < gain.abs()).all()
    assert torch.equal(net(embeds), before)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
