"""Bad input gets a clear error; every call leaves the model as it found it, also on errors and Ctrl-C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import (
    Deconvolution,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)


class Net(nn.Module):
    """Conv -> in-place ReLU -> BatchNorm -> dropout -> linear; ``fail`` raises inside the forward, after the ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 5 * 6, 3)
        self.fail: type[BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.relu(self.conv(x)))
        if self.fail is not None:
            raise self.fail("stop")
        return self.fc(self.drop(h).flatten(1))


def methods(model: nn.Module) -> list:
    return [
        Saliency(model),
        InputXGradient(model),
        IntegratedGradients(model, steps=4, internal_batch_size=4),
        IntegratedGradients(model, steps=3, layer="relu"),
        SmoothGrad(Saliency(model), samples=3, seed=0),
        GuidedBackprop(model),
        Deconvolution(model),
        GuidedGradCAM(model, "norm"),
    ]


def snapshot(model: nn.Module) -> dict:
    return {
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks))
            for m in model.modules()
        ],
    }


def assert_same(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]
    assert all(a is b for a, b in zip(after["grads"], before["grads"], strict=True))  # the same objects, untouched
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after["buffers"], before["buffers"], strict=True))
    assert after["hooks"] == before["hooks"]


@pytest.fixture
def model() -> Net:
    torch.manual_seed(0)
    net = Net().double().train()  # train mode on purpose: calls run in eval and restore it
    net.conv.weight.requires_grad_(False)
    net.fc.weight.grad = torch.ones_like(net.fc.weight)
    return net


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_method_leaves_the_model_and_the_inputs_as_found(model):
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    x_before = x.clone()
    model.eval()
    clean = model(x)
    model.train()
    before = snapshot(model)
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            for method in methods(model):
                out = method(x, target=1)
                assert out.shape[0] == 2 and torch.isfinite(out).all()
                assert torch.is_grad_enabled() == grad_mode
                assert_same(model, before)
    assert torch.equal(x, x_before) and not x.requires_grad
    model.eval()
    assert torch.equal(model(x), clean)  # observing changed nothing


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_the_model_is_restored_when_the_forward_raises(model, error):
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    before = snapshot(model)
    model.fail = error
    for method in methods(model):
        with pytest.raises(error):
            method(x, target=0)
        assert_same(model, before)
        assert torch.is_grad_enabled()


def test_bad_baselines_steps_and_methods_are_refused(model):
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`baseline` has shape \(3, 5, 6\), but `inputs` are \(2, 2, 5, 6\)"):
        IntegratedGradients(model, baseline=torch.zeros(3, 5, 6))(x, 0)
    with pytest.raises(ValueError, match="`baseline` returned"):
        IntegratedGradients(model, baseline=lambda z: z[:1, :1])(x, 0)
    with pytest.raises(TypeError, match=r"`baseline` is torch\.int64"):
        IntegratedGradients(model, baseline=torch.zeros(2, 5, 6, dtype=torch.long).expand(2, 2, 5, 6))(x, 0)
    for steps in (0, -3):
        with pytest.raises(ValueError, match=f"`steps` must be at least 1 for method='gausslegendre'; got {steps}"):
            IntegratedGradients(model, steps=steps)
    with pytest.raises(ValueError, match="at least 2 for method='riemann_trapezoid'"):
        IntegratedGradients(model, steps=1, method="riemann_trapezoid")
    with pytest.raises(TypeError, match="`steps` must be an integer"):
        IntegratedGradients(model, steps=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`method` must be one of 'gausslegendre'"):
        IntegratedGradients(model, method="simpson")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`internal_batch_size`"):
        IntegratedGradients(model, internal_batch_size=0)
    with pytest.raises(ValueError, match="`target` has 3 entries but the batch has 2"):
        Saliency(model)(x, [0, 1, 2])
    with pytest.raises(ValueError, match="`upsample` must be one of"):
        GuidedGradCAM(model, "norm", upsample="linear")
    with pytest.raises(KeyError, match="`layer` 'nrom'"):
        Saliency(model, layer="nrom")


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(9, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(ids).mean(1))


def test_token_ids_without_a_layer_point_to_the_embedding_layer():
    model, ids = Tokens(), torch.tensor([[1, 2, 3]])
    for method in (Saliency, InputXGradient, IntegratedGradients, GuidedBackprop):
        with pytest.raises(TypeError, match=r"torch.int64 \(token ids\?\).*layer='wte'"):
            method(model)(ids, 0)
    with pytest.raises(TypeError, match="SmoothGrad adds noise to `inputs`"):
        SmoothGrad(Saliency(model, layer="wte"))(ids, 0)
    assert IntegratedGradients(model, steps=4, layer="wte")(ids, 0).shape == (1, 3, 4)


def test_silent_garbage_is_named():
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    with pytest.warns(UserWarning, match="no ReLU, ReLU6 module"):
        GuidedBackprop(model)(torch.randn(2, 3), 0)
    with pytest.warns(UserWarning, match=r"items \[0, 1\] are all zero"):
        IntegratedGradients(model, steps=3, baseline=lambda z: z)(torch.randn(2, 3), 0)
    dead = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 2))
    with torch.no_grad():
        dead[0].bias.fill_(-100.0)
    with pytest.warns(UserWarning, match="item 0 are all zero|items .* are all zero"):
        Saliency(dead)(torch.randn(1, 3), 0)


def test_layer_that_runs_twice_or_returns_a_tuple_is_refused():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.rnn = nn.GRU(3, 3, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(self.lin(self.lin(x))[:, None])[0][:, 0]

    model, x = Twice(), torch.randn(2, 3)
    with pytest.raises(ValueError, match="`layer` 'lin' ran more than once"):
        Saliency(model, layer="lin")(x, 0)
    with pytest.raises(TypeError, match="`layer` 'rnn' returned a tuple"):
        Saliency(model, layer="rnn")(x, 0)
