"""Backward hooks: grad_input/grad_output line up with the forward's inputs/outputs, where PyTorch's fail too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import HookError, HookManager, Recorder
from tests.support import hook_state


def _reference_grads(model: nn.Module, names: list[str], x: torch.Tensor, loss_fn) -> dict:
    """Gradients of each call's true input and output, from an independent plain-PyTorch construction.

    Each module's input is replaced by a copy ``c`` and fed ``c.clone()``; its output ``o`` is replaced by
    ``o.clone()``. Nothing downstream can then write into ``c`` or ``o``, so ``autograd.grad`` with respect to them
    is the gradient through this call, of the true input and output.
    """
    calls: dict[tuple[str, int], dict] = {}
    counts: dict[str, int] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def pre(m, args, name=name):
            key = (name, counts.get(name, 0))
            calls[key] = {"in": args[0].clone()}
            return (calls[key]["in"].clone(),)

        def post(m, args, out, name=name):
            key = (name, counts.get(name, 0))
            counts[name] = key[1] + 1
            calls[key]["out"] = out
            return out.clone()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        loss = loss_fn(model(x))
        keys = list(calls)
        wanted = [calls[k]["in"] for k in keys if calls[k]["in"].requires_grad] + [calls[k]["out"] for k in keys]
        grads = iter(torch.autograd.grad(loss, wanted))
        result = {k: {"in": next(grads) if calls[k]["in"].requires_grad else None} for k in keys}
        for k in keys:
            result[k]["out"] = next(grads)
        return result
    finally:
        for h in handles:
            h.remove()


def test_resnet_grads_match_reference_with_inplace_ops_and_repeated_calls(resnet18):
    # bn2 is followed by `out += identity` (in place); relu is ReLU(inplace=True) and runs twice per block;
    # layer1.0's input is shared with the residual branch; conv1's input does not require grad.
    names = ["conv1", "maxpool", "layer1.0", "layer1.0.bn2", "layer1.0.relu", "layer2.0.downsample", "fc"]
    x = torch.randn(2, 3, 64, 64)

    def loss_fn(out):
        return out[:, 3].sum() + out[:, 7].pow(2).sum()

    got: dict[tuple[str, int], tuple] = {}
    before = hook_state(resnet18)
    with HookManager(resnet18).group("grads") as g:
        g.backward(names, lambda m, gi, go, *, name, call: got.__setitem__((name, call), (gi, go)))
        loss_fn(resnet18(x)).backward()
    assert hook_state(resnet18) == before
    resnet18.zero_grad()
    ref = _reference_grads(resnet18, names, x, loss_fn)
    assert sorted(got) == sorted(ref)
    assert ("layer1.0.relu", 1) in got  # one record per call
    for key, (grad_in, grad_out) in got.items():
        assert len(grad_in) == 1 and len(grad_out) == 1
        torch.testing.assert_close(grad_out[0], ref[key]["out"], rtol=0, atol=0)
        if ref[key]["in"] is None:
            assert grad_in[0] is None, key
        else:
            torch.testing.assert_close(grad_in[0], ref[key]["in"], rtol=0, atol=0)


def test_pytorch_full_backward_hook_fails_where_ours_works(resnet18):
    handle = resnet18.layer1[0].bn2.register_full_backward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="view and is being modified inplace"):
        resnet18(torch.randn(1, 3, 32, 32)).sum().backward()
    handle.remove()


class TupleDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, y=None, *, scale):
        h = self.lin(x) * scale
        return (h, h.sum(-1)) if y is None else {"a": h * y, "b": y.exp()}


def test_tuple_and_dict_outputs_keyword_only_and_no_grad_inputs():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.block = TupleDict()
    x = torch.randn(2, 3, requires_grad=True)
    y = torch.randn(2, 3, requires_grad=True)
    scale = torch.tensor(2.0)  # keyword-only and does not require grad
    got: list[tuple] = []
    with HookManager(model).group("g") as g:
        # autograd may later accumulate into a gradient tensor it handed out (x.grad here): keep clones
        g.backward(
            "block",
            lambda m, gi, go: got.append(
                tuple(tuple(t if t is None else t.clone() for t in grads) for grads in (gi, go))
            ),
        )
        _, s = model.block(x, scale=scale)
        s.sum().backward()  # only the second output is used
        out = model.block(x, y, scale=scale)
        out["a"].sum().backward()
    (gi1, go1), (gi2, go2) = got
    # inputs: leaves of (args, kwargs) = (x, scale) and (x, y, scale); outputs: (h, s) and (a, b)
    assert len(gi1) == 2 and gi1[1] is None
    # h is used inside the module to compute s, but nothing outside uses h: its grad_output is None, as in PyTorch
    assert go1[0] is None and torch.equal(go1[1], torch.ones(2))
    torch.testing.assert_close(gi1[0], torch.ones(2, 3) @ (model.block.lin.weight * 2))
    assert len(gi2) == 3 and gi2[2] is None and go2[1] is None
    torch.testing.assert_close(go2[0], torch.ones(2, 3))
    torch.testing.assert_close(gi2[0], (2 * y.detach()) @ model.block.lin.weight.detach())
    torch.testing.assert_close(gi2[1], (model.block.lin(x) * 2).detach())


def test_fires_once_per_backward_pass_and_with_autograd_grad(mlp):
    calls: list[tuple] = []
    x = torch.randn(2, 4, requires_grad=True)
    with HookManager(mlp).group("g") as g:
        g.backward(["0", "2"], lambda m, gi, go, *, name: calls.append((name, gi[0] is None)))
        out = mlp(x)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        assert calls == [("2", False), ("0", False)] * 2
        calls.clear()
        hidden = {}
        g2 = g.manager.group("keep")
        g2.forward("1", lambda m, a, o: hidden.setdefault("h", o))
        out = mlp(x)
        torch.autograd.grad(out.sum(), hidden["h"])  # stops at the ReLU: layer 0 gets only its output gradient
        g2.remove()
    assert calls == [("2", False)]


def test_module_writing_into_its_input_gets_its_gradient_at_every_call():
    class AddInPlace(nn.Module):
        def forward(self, x):
            return x.add_(1)

    model = nn.Sequential(nn.Linear(2, 2), AddInPlace(), nn.Linear(2, 1))
    got = []
    with HookManager(model).group("g") as g:
        g.backward("1", lambda m, gi, go: got.append(gi[0]))
        model(torch.randn(3, 2)).sum().backward()
        model(torch.randn(3, 2)).sum().backward()
    for grad in got:  # nothing is put between the caller's tensor and the module: the write keeps the graph whole
        torch.testing.assert_close(grad, model[2].weight.detach().expand(3, 2))


def test_backward_hook_must_not_return_a_value(mlp):
    with HookManager(mlp).group("g") as g:
        g.backward("2", lambda m, gi, go: gi)
        with pytest.raises(HookError, match="must return None"):
            mlp(torch.randn(1, 4, requires_grad=True)).sum().backward()


def test_no_backward_setup_without_grad(mlp):
    got = []
    with HookManager(mlp).group("g") as g:
        g.backward("0", lambda m, gi, go: got.append(1))
        with torch.no_grad():
            out = mlp(torch.randn(1, 4))
    assert out.grad_fn is None and got == []


def test_a_backward_hook_that_raised_fires_again_on_the_next_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    x = torch.randn(3, 2, requires_grad=True)
    calls = []

    def flaky(module, grad_input, grad_output):
        calls.append(grad_output[0].clone())
        if len(calls) == 1:
            raise ValueError("boom")

    with HookManager(model) as mgr:
        mgr.group("g").backward("1", flaky)  # fires before the recorder's hook on the same module
        with Recorder(model, "1", capture=("grad_output",), reduction="list", manager=mgr) as rec:
            loss = model(x).pow(2).sum()
            with pytest.raises(ValueError, match="boom"):
                loss.backward(retain_graph=True)
            loss.backward(retain_graph=True)
            loss.backward()
    assert len(calls) == 3 and torch.equal(calls[1], calls[2])
    assert len(rec["1"].grad_output) == 2  # the aborted pass is lost, the two after it are recorded


def test_deactivating_between_forward_and_backward_stops_the_backward_hook():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    fired = []
    with HookManager(model) as mgr:
        group = mgr.group("g")
        group.backward("1", lambda m, gi, go: fired.append(1))
        loss = model(torch.randn(1, 2, requires_grad=True)).sum()
        group.deactivate()
        loss.backward()
        assert fired == []
        group.activate()
        model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert fired == [1]
