"""Call numbers (``call=``): per module, in start order, restarted at each forward of the model, also after errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import HookManager, Recorder
from tests.support import hook_state


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


class Interruptible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.act = nn.ReLU()
        self.interrupt = False

    def forward(self, x):
        x = self.act(self.lin(x))
        if self.interrupt:
            raise KeyboardInterrupt
        return self.act(x)


def test_call_numbers_restart_after_a_keyboard_interrupt():
    model = Interruptible()
    calls = []
    mgr = HookManager(model)
    mgr.group("g").forward("act", lambda m, a, o, *, call: calls.append(call))
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(1, 2))
    model.interrupt = False
    model(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert calls == [0, 0, 1, 0, 1]
    mgr.remove_all()


def test_call_numbers_of_a_recursive_model_are_not_restarted_by_its_inner_call():
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, depth=1):
            x = self.lin(x)
            return x if depth == 0 else self(x, depth - 1)

    model, calls = Recursive(), []
    with HookManager(model) as mgr:
        mgr.group("g").forward("lin", lambda m, a, o, *, call: calls.append(call))
        model(torch.randn(1, 2))
        model(torch.randn(1, 2))
    assert calls == [0, 1, 0, 1]


def test_a_group_removing_itself_from_its_own_hook_leaves_numbering_intact():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, relu)
    mgr = HookManager(model)
    group = mgr.group("once")
    group.forward("1", lambda m, a, o: group.remove())  # the manager's only group: the model's hooks go too
    model(torch.randn(1, 2))
    calls = []
    mgr.group("later").forward("1", lambda m, a, o, *, call: calls.append(call))
    model(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert calls == [0, 1, 0, 1]
    mgr.remove_all()
