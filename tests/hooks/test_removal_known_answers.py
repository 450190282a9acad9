"""Removing hooks one way or another leaves the bookkeeping as if they had never been registered.

After each kind of removal (a handle, a function, a module, a group) the same function registers again on the same
module without a "registered twice" error, the hooks that were not removed still fire, in their order, and the
module's PyTorch hook dictionaries are empty once nothing of ours is left.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import HookError, HookManager


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))


def bare(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


class Probe:
    """Records ``(label, name)`` when fired; a bound method is a new object each time (equal, not identical)."""

    def __init__(self, log: list, label: str) -> None:
        self.log, self.label = log, label

    def forward(self, module, args, output, *, name):
        self.log.append((self.label, name))


def unhashable(log: list, label: str):
    """A callable that cannot be hashed: recognised by identity."""

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, module, args, output, *, name):
            log.append((label, name))

    return Unhashable()


@pytest.mark.parametrize("how", ["handle", "function", "module", "group"])
@pytest.mark.parametrize("kind", ["plain", "bound", "unhashable"])
def test_a_removed_hook_can_be_registered_again(how, kind):
    m, log = model(), []
    fn = {"plain": lambda *a, name: log.append(("fn", name)), "bound": Probe(log, "fn").forward}.get(kind)
    fn = fn if fn is not None else unhashable(log, "fn")
    with HookManager(m) as mgr:
        group = mgr.group("g")
        (handle,) = group.forward("0", fn)
        with pytest.raises(HookError, match="already a forward hook"):
            group.forward("0", fn)
        if how == "handle":
            handle.remove()
        elif how == "function":
            mgr.remove_function(Probe.forward.__get__(fn.__self__) if kind == "bound" else fn)
        elif how == "module":
            mgr.remove_module("0")
        else:
            group.remove()
            group = mgr.group("g")
        assert bare(m[0]) and bare(m)
        m(torch.randn(1, 2))
        assert log == []
        group.forward("0", fn)
        m(torch.randn(1, 2))
        assert log == [("fn", "0")]
    assert bare(m[0]) and bare(m)


def test_removing_one_kind_keeps_the_other_kind_of_the_same_function_registered():
    m, log = model(), []

    def hook(module, args, *rest, name):
        log.append((len(rest), name))

    with HookManager(m) as mgr:
        group = mgr.group("g")
        (forward,) = group.forward("0", hook)
        group.forward_pre("0", hook)
        forward.remove()
        with pytest.raises(HookError, match="already a forward_pre hook"):
            group.forward_pre("0", hook)
        m(torch.randn(1, 2))
        assert log == [(0, "0")]  # the pre-hook (no output argument) still fires
        group.forward("0", hook)  # and the forward one can come back
        m(torch.randn(1, 2))
        assert log == [(0, "0"), (0, "0"), (1, "0")]


def test_removing_one_module_keeps_the_function_on_the_others_in_order():
    m, log = model(), []
    first, second = Probe(log, "a"), Probe(log, "b")
    with HookManager(m) as mgr:
        mgr.group("low").forward(["0", "2"], second.forward)
        mgr.group("high", priority=1).forward(["0", "2"], first.forward)
        mgr.remove_module("2")
        assert bare(m[2]) and not bare(m[0])
        m(torch.randn(1, 2))
        assert log == [("a", "0"), ("b", "0")]
        mgr.group("low").forward("2", second.forward)
        mgr.group("high").forward("2", first.forward)
        log.clear()
        m(torch.randn(1, 2))
        assert log == [("a", "0"), ("b", "0"), ("a", "2"), ("b", "2")]
        assert [h.module_name for h in mgr.handles()] == ["0", "0", "2", "2"]


def test_the_same_function_in_two_groups_is_removed_from_one_only():
    m, log = model(), []
    hook = Probe(log, "p").forward
    with HookManager(m) as mgr:
        (in_a,) = mgr.group("a").forward("0", hook)
        mgr.group("b").forward("0", hook)
        in_a.remove()
        m(torch.randn(1, 2))
        assert log == [("p", "0")]
        with pytest.raises(HookError):
            mgr.group("b").forward("0", hook)
        mgr.group("a").forward("0", hook)
        assert len(mgr) == 2


@pytest.mark.parametrize("kind", ["forward_pre", "backward"])
def test_pre_and_backward_hooks_can_be_registered_again_after_removal(kind):
    m, log = model(), []

    def pre(module, args, *, name):
        log.append(name)

    def backward(module, grad_input, grad_output, *, name):
        log.append(name)

    fn = pre if kind == "forward_pre" else backward
    with HookManager(m) as mgr:
        group = mgr.group("g")
        (handle,) = getattr(group, kind)("2", fn)
        handle.remove()
        getattr(group, kind)("2", fn)
        m(torch.randn(1, 2, requires_grad=True)).sum().backward()
        assert log == ["2"]
    assert bare(m[2]) and bare(m)
