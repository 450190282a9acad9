"""Random sequences of hook operations checked against a small reference model of which hooks fire, in what order.

The model calls a shared ReLU twice, so call numbers matter. The reference keeps, per registered hook: its group
(with priority), kind, module and whether it is active; the expected firing order of a forward is, per module call
in start order, its active pre-hooks then its active forward hooks, each sorted by (-priority, registration order);
a backward fires, in reverse call order, the backward hooks active both at the forward and at the backward.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from hooks import HookError, HookManager
from tests.support import hook_state

MODULES = ["0", "1", "2"]
CALLS = [("0", 0), ("1", 0), ("2", 0), ("1", 1)]  # the model runs 0, 1, 2, 1
KINDS = ["forward_pre", "forward", "backward"]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name, module in zip(MODULES, (nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)), strict=True):
            self.add_module(name, module)
        self.fail = False

    def forward(self, x):
        first, relu, second = (getattr(self, name) for name in MODULES)
        x = relu(second(relu(first(x))))
        if self.fail:
            raise KeyboardInterrupt
        return x


class Hook:
    """One registration in the reference: which function, where, in which group, active or not."""

    def __init__(self, tag: int, group, kind: str, module: str, handle) -> None:
        self.tag, self.group, self.kind, self.module, self.handle = tag, group, kind, module, handle  # group: object
        self.active = True


class HookMachine(RuleBasedStateMachine):
    groups = Bundle("groups")
    pick = st.integers(0, 1000)  # a live hook, by position

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.before = hook_state(self.model)
        self.mgr = HookManager(self.model)
        self.log: list[tuple] = []
        self.live: dict[int, Hook] = {}  # tag -> hook
        self.entered: list = []  # group objects inside `with group:` blocks, innermost last
        self.tags = itertools.count()

    # -- the reference ---------------------------------------------------------------------------------------
    def _order(self, hooks: list[Hook]) -> list[Hook]:
        return sorted(hooks, key=lambda h: (-h.group.priority, h.tag))

    def _expected_forward(self) -> list[tuple]:
        expected = []
        for module, call in CALLS:
            for kind in ("forward_pre", "forward"):
                here = [h for h in self.live.values() if h.module == module and h.kind == kind and h.active]
                expected += [(h.tag, kind, module, call) for h in self._order(here)]
        return expected

    def _active_backward(self) -> dict[tuple[str, int], list[int]]:
        return {
            (module, call): [
                h.tag
                for h in self._order(list(self.live.values()))
                if h.module == module and h.kind == "backward" and h.active
            ]
            for module, call in CALLS
        }

    def _fn(self, tag: int, kind: str):
        if kind == "forward_pre":
            return lambda module, args, *, name, call: self.log.append((tag, kind, name, call))
        if kind == "forward":
            return lambda module, args, output, *, name, call: self.log.append((tag, kind, name, call))
        return lambda module, grad_input, grad_output, *, name, call: self.log.append((tag, kind, name, call))

    def _pick(self, i: int) -> Hook | None:
        live = sorted(self.live)
        return self.live[live[i % len(live)]] if live else None

    # -- rules -------------------------------------------------------------------------------------------------
    @initialize(target=groups)
    def low(self):
        self.mgr.group("low", -1)
        return "low"

    @initialize(target=groups)
    def high(self):
        self.mgr.group("high", 2)
        return "high"

    @rule(target=groups, name=st.sampled_from("abc"), priority=st.integers(-1, 1))
    def new_group(self, name, priority):
        if name not in self.mgr.groups:
            self.mgr.group(name, priority)
        return name

    @rule(group=groups, kind=st.sampled_from(KINDS), module=st.sampled_from(MODULES), active=st.booleans())
    def register(self, group, kind, module, active):
        if group not in self.mgr.groups:
            return
        tag = next(self.tags)
        (handle,) = getattr(self.mgr.groups[group], kind)(module, self._fn(tag, kind), activate=active)
        hook = self.live[tag] = Hook(tag, self.mgr.groups[group], kind, module, handle)
        hook.active = active

    @rule(first=groups, second=groups, kind=st.sampled_from(KINDS), module=st.sampled_from(MODULES))
    def register_in_two_groups(self, first, second, kind, module):
        """Where groups of different priorities meet on one module, their order matters."""
        self.register(first, kind, module, True)
        self.register(second, kind, module, True)

    @rule(i=pick, on=st.booleans())
    def switch_hook(self, i, on):
        hook = self._pick(i)
        if hook is not None:
            hook.handle.activate() if on else hook.handle.deactivate()
            hook.active = on

    @rule(group=groups, on=st.booleans())
    def switch_group(self, group, on):
        if group in self.mgr.groups:
            self.mgr.groups[group].activate() if on else self.mgr.groups[group].deactivate()
            for h in self.live.values():
                if h.group is self.mgr.groups[group]:
                    h.active = on

    @rule(i=pick)
    def remove_hook(self, i):
        hook = self._pick(i)
        if hook is not None:
            del self.live[hook.tag]
            hook.handle.remove()

    @rule(group=groups)
    def remove_group(self, group):
        if group in self.mgr.groups:
            removed = self.mgr.groups[group]
            removed.remove()
            self._forget(lambda h: h.group is removed)

    @rule(module=st.sampled_from(MODULES))
    def remove_module(self, module):
        self.mgr.remove_module(module)
        self._forget(lambda h: h.module == module)

    def _forget(self, which) -> None:
        for tag in [t for t, h in self.live.items() if which(h)]:
            del self.live[tag]

    @rule(group=groups)
    def enter_group(self, group):
        if group not in self.mgr.groups:
            return
        obj = self.mgr.groups[group]
        if any(g is obj for g in self.entered):
            try:
                obj.__enter__()
            except HookError:
                return
            raise AssertionError("entering a group inside its own with block must raise")
        obj.__enter__()
        self.entered.append(obj)

    @precondition(lambda self: self.entered)
    @rule()
    def exit_group(self):
        group = self.entered.pop()
        group.__exit__(None, None, None)  # removes it (again, if it was removed meanwhile)
        assert group.removed
        self._forget(lambda h: h.group is group)

    @rule(grad=st.booleans())
    def forward(self, grad):
        self.log.clear()
        with torch.set_grad_enabled(grad):
            self.model(torch.randn(2, 3))
        assert self.log == self._expected_forward()

    @rule(switch_off=st.lists(pick, max_size=2))
    def forward_and_backward(self, switch_off):
        self.log.clear()
        x = torch.randn(2, 3, requires_grad=True)
        out = self.model(x)
        assert self.log == self._expected_forward()
        at_forward = self._active_backward()
        for i in switch_off:  # deactivated between the forward and the backward
            hook = self._pick(i)
            if hook is not None:
                hook.handle.deactivate()
                hook.active = False
        at_backward = self._active_backward()
        self.log.clear()
        out.pow(2).sum().backward()
        expected = []
        for module, call in reversed(CALLS):
            fired = [t for t in at_forward[module, call] if t in at_backward[module, call]]
            expected += [(t, "backward", module, call) for t in fired]
        assert self.log == expected

    @rule()
    def interrupted_forward(self):
        self.model.fail = True
        try:
            self.model(torch.randn(2, 3))
        except KeyboardInterrupt:
            pass
        finally:
            self.model.fail = False

    # -- invariants --------------------------------------------------------------------------------------------
    @invariant()
    def registry_matches_the_reference(self):
        assert sorted(h.tag for h in self.live.values()) == sorted(
            next(t for t, h in self.live.items() if h.handle is handle) for handle in self.mgr.handles()
        )
        for h in self.live.values():
            assert h.handle.is_active() == h.active

    def teardown(self):
        while self.entered:
            self.exit_group()
        self.mgr.remove_all()
        assert hook_state(self.model) == self.before  # the model carries exactly its own hooks again


HookMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same sequences on every run and machine
    suppress_health_check=[HealthCheck.too_slow],
)
TestHookMachine = HookMachine.TestCase
