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


# -- parameters that stop being parameters during or before the call -----------------------------------------------
class BiasDropper(nn.Module):
    """A small CNN whose forward removes its head's bias (sets it to ``None``), as a pruning hook could."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.head.bias = None
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("method", ["GradCAM", "deletion"])
def test_a_parameter_set_to_none_during_the_call_is_put_back(method):
    torch.manual_seed(0)
    model = BiasDropper()
    bias = model.head.bias
    bias.requires_grad_(False)
    grad = torch.full_like(bias, 3.0)
    bias.grad = grad
    calls(model, torch.randn(2, 2, 5, 6))[method]()
    assert model.head.bias is bias
    assert not bias.requires_grad and bias.grad is grad
    assert [name for name, _ in model.named_parameters()] == ["conv.weight", "conv.bias", "head.weight", "head.bias"]


def shadowed_bias_net() -> nn.Module:
    """A net whose conv has no bias, in the state zennit's SequentialMergeBatchNorm leaves it after removal.

    Merging gives the conv a registered ``bias`` parameter; removing the merge sets the attribute back to ``None``
    with ``object.__setattr__``, which shadows the registered parameter: ``named_parameters()`` still lists it,
    ``conv.bias`` reads ``None`` and the forward runs without a bias.
    """
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 6, 4))
    model[0].bias = nn.Parameter(torch.full((3,), 5.0))
    object.__setattr__(model[0], "bias", None)
    return model


def test_a_parameter_shadowed_by_none_as_zennit_leaves_it_keeps_its_state():
    model, x = shadowed_bias_net(), torch.randn(2, 2, 5, 6)
    hidden = model[0]._parameters["bias"]
    assert model[0].bias is None and hidden is not None and hidden.requires_grad
    plain = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 6, 4))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "0.bias"})
    got = GradCAM(model, "0")(x, [0, 3])  # HookedRun turns every parameter's requires_grad off, then back on
    torch.testing.assert_close(got, GradCAM(plain, "0")(x, [0, 3]))  # the forward saw no bias
    assert model[0].bias is None and model[0]._parameters["bias"] is hidden
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.peers
def test_after_zennits_batch_norm_canonizer_an_lrp_call_leaves_the_model_as_found():
    """The crash of issue 40: zennit's SequentialMergeBatchNorm applied to the model and removed, then our LRP."""
    canonizers = pytest.importorskip("zennit.canonizers")
    composites = pytest.importorskip("zennit.composites")
    zennit_attribution = pytest.importorskip("zennit.attribution")
    from attribution.lrp import LRP, EpsilonPlus

    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(90, 4)
    ).eval()
    x = torch.randn(2, 2, 5, 6)
    composite = composites.EpsilonPlus(canonizers=[canonizers.SequentialMergeBatchNorm()])
    with zennit_attribution.Gradient(model, composite) as attributor:
        attributor(x, torch.eye(4)[[1, 3]])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()]
    LRP(model, EpsilonPlus())(x, target=[1, 3])
    assert [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()] == flags
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
