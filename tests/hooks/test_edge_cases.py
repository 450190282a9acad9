"""Edge cases found in review: side effects, aliasing, recursion, shared modules, table cleanup, call numbering."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from hooks import HookManager, Recorder
from tests.conftest import hook_state


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


def test_recursive_calls_are_numbered_in_start_order():
    class Recursive(nn.Module):
        def forward(self, x, depth=1):
            return x + 1 if depth == 0 else self(x * 10, depth - 1)

    model = nn.Sequential()
    model.r = Recursive()
    seen_pre, seen_post = [], []
    with HookManager(model).group("g") as g:
        g.forward_pre("r", lambda m, args, *, call: seen_pre.append((call, float(args[0]))))
        g.forward("r", lambda m, args, out, *, call: seen_post.append((call, float(args[0]))))
        model.forward = lambda x: model.r(x)  # type: ignore[method-assign]
        model(torch.tensor(1.0))
    assert seen_pre == [(0, 1.0), (1, 10.0)]
    assert sorted(seen_post) == [(0, 1.0), (1, 10.0)]


def test_each_dispatcher_sits_where_the_manager_first_needed_it(mlp):
    log = []
    mgr = HookManager(mlp)
    mgr.group("g").forward("0", lambda m, a, o: log.append("mgr forward 1"))
    raw_pre = mlp[0].register_forward_pre_hook(lambda m, a: log.append("raw pre"))
    raw_forward = mlp[0].register_forward_hook(lambda m, a, o: log.append("raw forward"))
    mgr.group("g").forward_pre("0", lambda m, a: log.append("mgr pre"))  # the first pre-hook: after "raw pre"
    mgr.group("g").forward("0", lambda m, a, o: log.append("mgr forward 2"))  # joins the forward dispatcher
    mlp(torch.randn(1, 4))
    assert log == ["raw pre", "mgr pre", "mgr forward 1", "mgr forward 2", "raw forward"]
    raw_pre.remove()
    raw_forward.remove()
    mgr.remove_all()


def test_group_lookup_and_unhashable_callables(mlp):
    mgr = HookManager(mlp)
    shared = mgr.group("shared", threads="all", priority=3)
    assert mgr.group("shared") is shared

    @dataclass
    class Hook:  # a dataclass with eq=True is unhashable
        seen: list

        def __call__(self, module, args, output):
            self.seen.append(module)

    hook = Hook([])
    shared.forward(["0", "2"], hook)
    mlp(torch.randn(1, 4))
    assert len(hook.seen) == 2
    mgr.remove_function(hook)
    assert mgr.handles() == []
    mgr.remove_all()


def test_shared_module_answers_to_every_path():
    torch.manual_seed(0)
    block = nn.Linear(2, 2)
    model = nn.Sequential()
    model.a, model.b = nn.Sequential(block), nn.Sequential(block)
    with HookManager(model) as mgr:
        (handle,) = mgr.group("g").forward("b.0", lambda m, a, o: None)
    assert handle.module is block and handle.module_name == "b.0"  # named by the path it was asked by


def test_removed_recorder_is_not_kept_alive_by_a_shared_manager(mlp):
    mgr = HookManager(mlp)
    rec = Recorder(mlp, "0", manager=mgr)
    mlp(torch.randn(1, 4))
    rec.remove()
    ref = weakref.ref(rec)
    del rec
    gc.collect()
    assert ref() is None
    assert mgr.handles() == [] and mgr.groups == {}


def test_a_submodule_called_on_its_own_numbers_each_call_zero(mlp):
    with Recorder(mlp, "0", reduction="sum") as rec:
        inputs = [torch.randn(2, 4) for _ in range(4)]
        for x in inputs:
            mlp[0](x)
    assert list(rec) == [("0", 0)] and rec["0"].samples == 4
    torch.testing.assert_close(rec["0"].output, sum(mlp[0](x) for x in inputs).detach())
    assert hook_state(mlp) == hook_state(nn.Sequential(*mlp))  # nothing left (same modules, no wrapper hooks)


def test_call_numbering_survives_a_forward_that_raised():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, nn.Linear(2, 2), relu)
    calls = []
    with HookManager(model).group("g") as g:
        g.forward(relu, lambda m, a, o, *, call: calls.append(call))
        try:
            model(torch.randn(1, 3))  # wrong width: raises inside the first Linear
        except RuntimeError:
            pass
        model(torch.randn(1, 2))
    assert calls == [0, 1]
