"""Registering hooks one name at a time: the same work for each, few objects for the garbage collector, no garbage.

CPython's full collections walk every tracked object; the more each registration adds, the sooner and the more
often they run while thousands of names are registered. Counted, not timed (benchmarks/hooks_overhead.py times it).
"""

from __future__ import annotations

import gc
import sys

import pytest
from torch import nn

from hooks import HookManager

PER_REGISTRATION = 10  # handle, key, slot and its record, entries, dispatcher, 2 weak refs, copy filter, __dict__


def _noop(module, args, output=None):
    return None


def _tracked_per_registration(kind: str, n: int = 200) -> float:
    model = nn.Sequential(*[nn.Identity() for _ in range(n + 1)])
    manager = HookManager(model)
    group = manager.group("one-by-one")
    register = group.forward if kind == "forward" else group.forward_pre
    register("0", _noop)  # the model's own hooks, the group: made once
    gc.collect()
    before = len(gc.get_objects())
    for i in range(1, n + 1):
        register(str(i), _noop)
    gc.collect()
    per = (len(gc.get_objects()) - before) / n
    manager.remove_all()
    return per


def _calls_per_registration(n: int) -> float:
    """Python and C function calls per ``group.forward(name, fn)``, for ``n`` names of an ``n + 1``-module model."""
    model = nn.Sequential(*[nn.Identity() for _ in range(n + 1)])
    manager = HookManager(model)
    group = manager.group("one-by-one")
    group.forward("0", _noop)  # the model's own hooks, the group: made once
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        for i in range(1, n + 1):
            group.forward(str(i), _noop)
    finally:
        sys.setprofile(None)
    manager.remove_all()
    return calls / n


def test_a_registration_does_the_same_work_however_many_hooks_are_there():
    """Linear in the number of hooks: no step of a registration walks the hooks, slots or modules already there."""
    assert _calls_per_registration(1200) == pytest.approx(_calls_per_registration(300), abs=0.05)


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_each_registration_leaves_a_bounded_number_of_tracked_objects(kind):
    # the fewest of three counts: an object that something else makes once (a lazily filled cache after a thousand
    # other tests) lands in one count only, while what each registration keeps is in every count
    assert min(_tracked_per_registration(kind) for _ in range(3)) <= PER_REGISTRATION


def test_registering_and_removing_one_name_at_a_time_makes_no_garbage():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(100)])
    gc.collect()
    gc.disable()
    try:
        with HookManager(model) as manager:
            group = manager.group("g")
            for i in range(100):
                group.forward(str(i), _noop)
                group.backward(str(i), lambda m, gi, go: None)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0
