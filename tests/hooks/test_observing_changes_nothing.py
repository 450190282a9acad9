"""Observing never changes the computation: outputs, gradients and in-place side effects stay bitwise the same."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hooks import HookManager, Recorder
from tests.support import hook_state


class SideEffect(nn.Module):
    """Relies on an in-place module changing its argument, and returns that argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.lin(x)
        self.act(y)
        return y


def test_backward_hooks_keep_inplace_side_effects_and_identity():
    torch.manual_seed(0)
    model = SideEffect()
    x = torch.randn(4, 3, requires_grad=True)
    plain = model(x)
    got = []
    returned = {}
    with HookManager(model).group("g") as g:
        g.backward("act", lambda m, gi, go: got.append((gi[0].clone(), go[0].clone())))
        g.forward_pre("act", lambda m, args: returned.setdefault("in", args[0]))
        g.forward("act", lambda m, args, out: returned.setdefault("out", out))
        hooked = model(x)
        hooked.sum().backward()
    torch.testing.assert_close(hooked, plain)
    assert float(hooked.detach().min()) >= 0  # the ReLU's write reached the caller's tensor
    ((grad_in, grad_out),) = got
    torch.testing.assert_close(grad_out, torch.ones(4, 3))
    torch.testing.assert_close(grad_in, (model.lin(x) > 0).float())


def test_identity_like_module_output_is_hooked_without_a_lasting_hook_on_a_parameter():
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self):
            return self.w

    model = nn.Sequential()
    model.c = Constant()
    grads = []
    with HookManager(model).group("g") as g:
        g.backward("c", lambda m, gi, go: grads.append(go[0].clone()))
        for _ in range(3):
            (model.c() * 2).sum().backward()
    assert len(grads) == 3 and all(torch.equal(gr, torch.full((3,), 2.0)) for gr in grads)
    assert not model.c.w._backward_hooks  # no tensor hook piled up on the parameter


def _grads(model: nn.Module, x: torch.Tensor, loss) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    loss(out).backward()
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def _bitwise(a: list, b: list) -> bool:
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b, strict=True)
    )


class WritesIntoOutput(nn.Module):
    """The caller writes into the output of an identity-like module and relies on the write reaching its input."""

    def __init__(self, inner: nn.Module, flat: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner
        self.flat = flat

    def forward(self, x):
        y = self.lin(x)
        z = self.inner(y)
        z.mul_(2)  # reaches y when z shares y's memory
        return (y * y).sum(-1) + z.sum(-1)


@pytest.mark.parametrize(
    "inner", [nn.Identity(), nn.Dropout(0.5).eval(), nn.Flatten(0, -1)], ids=["Identity", "Dropout-eval", "Flatten"]
)
def test_observing_an_identity_like_module_keeps_writes_to_its_output(inner):
    torch.manual_seed(0)
    model = WritesIntoOutput(inner)
    x = torch.randn(3, 4)
    out_ref, grads_ref = _grads(model, x, lambda o: o.sum())
    with Recorder(model, "inner", capture=("output", "grad_output", "grad_input")):
        with pytest.warns(RuntimeWarning, match="then modified in place"):
            out, grads = _grads(model, x, lambda o: o.sum())
    assert torch.equal(out, out_ref)  # the write reached the input, as without the recorder
    if isinstance(inner, nn.Flatten):
        assert _bitwise(grads, grads_ref)
    else:
        # Without hooks, the caller's write lands on its own tensor; with a per-call alias it is a write through a
        # view, and autograd adds the same gradient terms in another order: equal up to float rounding.
        for got, ref in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=4 * torch.finfo(ref.dtype).eps * ref.abs().max().item())


def test_identity_output_used_out_of_place_gets_its_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Identity(), nn.Tanh())
    x = torch.randn(2, 3)
    out_ref, grads_ref = _grads(model, x, lambda o: o.pow(2).sum())
    with Recorder(model, "1", capture=("grad_input", "grad_output")) as rec:
        out, grads = _grads(model, x, lambda o: o.pow(2).sum())
    assert torch.equal(out, out_ref) and _bitwise(grads, grads_ref)
    h = model[0](x)
    expected = 2 * torch.tanh(h) * (1 - torch.tanh(h) ** 2)
    torch.testing.assert_close(rec["1"].grad_output, expected.detach())
    torch.testing.assert_close(rec["1"].grad_input, expected.detach())


def test_multihead_self_attention_is_bitwise_equal_with_a_backward_recorder():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)

    def run():
        mha.zero_grad(set_to_none=True)
        q = x.clone().requires_grad_(True)
        out = mha(q, q, q)[0]  # `query is key is value` selects a packed projection
        out.pow(2).sum().backward()
        return out.detach(), [q.grad] + [p.grad for p in mha.parameters()]

    out_ref, grads_ref = run()
    with Recorder(mha, "", capture=("grad_input", "grad_output")) as rec:
        out, grads = run()
    assert torch.equal(out, out_ref) and _bitwise(grads, grads_ref)
    q_grad, k_grad, v_grad = rec[""].grad_input  # one tensor passed three times: its gradient once, at the first
    assert torch.equal(q_grad, grads_ref[0]) and not k_grad.any() and not v_grad.any()


def test_observing_every_module_of_common_models_changes_nothing(resnet18):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    lstm = nn.Sequential()
    lstm.rnn = nn.LSTM(4, 6, batch_first=True)
    for model, x, loss in [
        (resnet18, torch.randn(2, 3, 32, 32), lambda o: o.logsumexp(-1).sum()),
        (vit, torch.randn(2, 3, 32, 32), lambda o: o.pow(2).sum()),
        (lstm, torch.randn(2, 5, 4), lambda o: o[0].sum() + o[1][0].pow(2).sum()),
    ]:
        before = hook_state(model)
        runs = []
        for observe in (False, True):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            fields = ("input", "output", "grad_input", "grad_output")
            with Recorder(model, "**", capture=fields) if observe else contextlib.nullcontext():
                out = model(xi)
                loss(out).backward()
            runs.append((torch.utils._pytree.tree_leaves(out), [xi.grad] + [p.grad for p in model.parameters()]))
        (outs_ref, grads_ref), (outs, grads) = runs
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(outs_ref, outs, strict=True))
        assert _bitwise(grads, grads_ref), type(model).__name__
        assert hook_state(model) == before


@dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self, factory) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.factory = factory

    def forward(self, x):
        y = self.lin(x)
        return self.factory(y, 3 * y)


def _factories():
    yield "dataclass", lambda a, b: Pair(a, b), lambda o: (o.a, o.b)
    transformers = pytest.importorskip("transformers.modeling_outputs")
    yield (
        "ModelOutput",
        lambda a, b: transformers.BaseModelOutput(last_hidden_state=a, hidden_states=(b,)),
        lambda o: (o.last_hidden_state, o.hidden_states[0]),
    )


@pytest.mark.parametrize("kind", ["dataclass", "ModelOutput"])
def test_dataclass_outputs_are_recorded_as_copies_with_gradients(kind):
    _, factory, parts = {f[0]: f for f in _factories()}[kind]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.m = ReturnsDataclass(factory)
    x = torch.randn(4, 2)
    with Recorder(model, "m", capture=("output", "grad_output")) as rec:
        out = model(x)
        a, b = parts(out)
        (a.pow(2).sum() + b.sum()).backward()
    rec_a, _ = parts(rec["m"].output)
    assert rec_a is not a and not rec_a.requires_grad and torch.equal(rec_a, a.detach())
    grad_a, grad_b = rec["m"].grad_output
    torch.testing.assert_close(grad_a, 2 * a.detach())
    torch.testing.assert_close(grad_b, torch.ones_like(b))
