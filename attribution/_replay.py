"""Replay, in an exact patching sweep, the module calls that finish before a cell's site.

Until a cell's site runs, the patched forward is the unpatched run of the same input: every module call that has
finished by then returns what it returned in that run. :class:`CallLog` runs the target input once and records every
module call (its start and end in call order, its nesting, a copy of its output); :func:`plan_sites` picks, for
each site, the outermost calls that end before it (for an output site, at its end: the site's own call included),
and :class:`Replay` makes those calls return a fresh copy of their recorded output instead of running.

A call is replayed only when doing so cannot be told apart from running it:

* its output holds tensors (in tuples, lists, dicts, ``ModelOutput``) and plain values only, and none of its tensors
  shares memory with the call's inputs or with the model's parameters and buffers (an identity-like module, a view:
  an in-place change later in the forward would reach them);
* every module that runs inside it runs only inside it (a module shared with later code keeps its call numbers);
* neither its module nor any module inside it carries hooks of its own (the user's hooks keep firing).

Replay is not used at all when global module hooks are registered or when the traced run drew random numbers; and a
check run that replays everything before the last site must give the traced output bitwise, else a warning says
so and the sweep runs without replay.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookManager, flatten, global_hooks_registered, map_tensors, tensors

from ._run import warn

Plan = dict[tuple[int, int], Any]  # (module id, call number) -> the recorded output to return
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


@dataclass(eq=False)
class _Call:
    module: nn.Module
    name: str
    index: int  # the module's call number within the forward
    parent: _Call | None
    start: int
    inputs: set[int]  # storage addresses of the tensors passed in
    end: int = -1
    output: Any = None
    replayable: bool = False  # the output is plain and shares no memory with the inputs or the model's state
    children: list[_Call] = field(default_factory=list)
    inside: list[_Call] = field(default_factory=list)  # every call below this one


def _rng_state() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors(value)}


def _copy(value: Any) -> Any:
    return map_tensors(torch.Tensor.clone, value)


class CallLog:
    """Every module call of one forward of ``model``: order, nesting, output copies (see the module documentation)."""

    def __init__(self, model: nn.Module, forward: Callable[[Any], Any], inputs: Any) -> None:
        self.calls: list[_Call] = []
        self.random = False
        state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        stack: list[_Call] = []
        clock = iter(range(1 << 62))
        broken = False

        def start(module: nn.Module, args: Any, kwargs: Any, *, name: str, call: int) -> None:
            parent = stack[-1] if stack else None
            entry = _Call(module, name, call, parent, next(clock), _storages((args, kwargs)))
            self.calls.append(entry)
            for above in stack:
                above.inside.append(entry)
            if parent is not None:
                parent.children.append(entry)
            stack.append(entry)

        def end(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
            nonlocal broken
            if not stack or stack[-1].module is not module:  # a call we did not see start: trust nothing
                broken = True
                return
            entry = stack.pop()
            entry.end = next(clock)
            leaves = flatten(output)[0]
            found = [t for t in leaves if isinstance(t, torch.Tensor)]
            plain = all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in leaves)
            shared = {t.untyped_storage().data_ptr() for t in found} & (entry.inputs | state)
            if plain and not shared and all(type(t) is torch.Tensor for t in found):
                entry.replayable = True
                entry.output = _copy(output)  # later in-place changes must not reach the copy

        submodules = [m for m in model.modules() if m is not model]
        before = _rng_state()
        with HookManager(model) as manager:
            group = manager.group("patching-trace", threads="current")
            if submodules:
                group.forward_pre(submodules, start, with_kwargs=True)
                group.forward(submodules, end)
            self.output = forward(inputs)
        self.random = any(not torch.equal(a, b) for a, b in zip(before, _rng_state(), strict=True))
        if stack or broken:  # a call ended that did not start in order, or one never ended: replay nothing
            self.calls = []

    def site(self, name: str, site: Literal["output", "input"]) -> int | None:
        """The clock time of the site: the start (input) or end (output) of the module's first call; None: no call."""
        first = next((c for c in self.calls if c.name == name), None)
        if first is None:
            return None
        return first.start if site == "input" else first.end + 1  # output: its own call ends before the site


def plan_sites(trace: CallLog, times: Sequence[int | None], hooked: set[int]) -> list[dict[tuple[int, int], Any]]:
    """The calls to replay for a site at each clock time (None: no site, nothing replayed).

    A plan maps ``(module id, call number)`` to the recorded output. Which calls may be replayed does not depend on
    the site, so it is decided once for all of them.
    """
    calls_of: dict[int, int] = {}
    for c in trace.calls:
        calls_of[id(c.module)] = calls_of.get(id(c.module), 0) + 1

    def usable(c: _Call) -> bool:
        if not c.replayable or id(c.module) in hooked:
            return False
        counts: dict[int, int] = {}
        for below in c.inside:
            if id(below.module) in hooked:
                return False
            counts[id(below.module)] = counts.get(id(below.module), 0) + 1
        return all(calls_of[key] == n for key, n in counts.items())  # modules inside run only inside

    replayable = {id(c) for c in trace.calls if usable(c)}

    def plan(time: int) -> dict[tuple[int, int], Any]:
        chosen: dict[tuple[int, int], Any] = {}

        def cover(c: _Call) -> None:
            if id(c) in replayable:
                chosen[id(c.module), c.index] = c.output
            else:
                for child in c.children:
                    cover(child)

        for c in trace.calls:
            if c.parent is None or c.parent.end >= time:  # outermost among the calls that end before the site
                if c.end < time:
                    cover(c)
        return chosen

    return [plan(t) if t is not None else {} for t in times]


class Replay:
    """Make chosen module calls return a copy of their recorded output (see the module documentation).

    Used as ``with Replay(model, modules) as replay:``, then ``replay.use(chosen)`` before each forward. Only the
    calls of the thread that entered are replayed; every module's ``forward`` is restored at exit. A replayed call
    returns ``copy(recorded output)``: a fresh clone by default, or what ``use(chosen, copy)`` makes of it (a batch
    repeated, for a forward of more rows than the recorded one).
    """

    def __init__(self, model: nn.Module, modules: Sequence[nn.Module]) -> None:
        self.model = model
        self.modules = list({id(m): m for m in modules}.values())
        self.chosen: dict[tuple[int, int], Any] = {}
        self._copy: Callable[[Any], Any] = _copy
        self._pending: dict[int, int] = {}
        self._owner = threading.get_ident()
        self._saved: list[tuple[nn.Module, Any]] = []

    def use(self, chosen: dict[tuple[int, int], Any], copy: Callable[[Any], Any] = _copy) -> None:
        """Replay ``chosen`` from the next forward on; ``copy`` makes a call's result from its recorded output."""
        self.chosen = chosen
        self._copy = copy
        self._pending.clear()

    def __enter__(self) -> Replay:
        self._manager = HookManager(self.model)
        try:
            if self.modules:
                self._manager.group("patching-replay", threads="current").forward_pre(self.modules, self._arm)
            for module in self.modules:
                self._saved.append((module, module.__dict__.get("forward")))
                module.forward = self._replayer(module)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for module, own in reversed(self._saved):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._saved.clear()
        self._manager.remove_all()

    def _arm(self, module: nn.Module, args: Any, *, call: int) -> None:
        if threading.get_ident() == self._owner:
            self._pending[id(module)] = call

    def _replayer(self, module: nn.Module) -> Callable[..., Any]:
        original = module.forward
        key = id(module)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._pending.pop(key, None) if threading.get_ident() == self._owner else None
            if call is not None and (key, call) in self.chosen:
                return self._copy(self.chosen[key, call])
            return original(*args, **kwargs)

        return forward


def same_output(a: Any, b: Any) -> bool:
    """Whether two model outputs have the same structure and equal tensors (``nan`` where the other has ``nan``)."""
    leaves_a, spec_a = flatten(a)
    leaves_b, spec_b = flatten(b)
    if spec_a != spec_b:
        return False
    pairs = list(zip(leaves_a, leaves_b, strict=True))
    if any(isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor) for x, y in pairs):
        return False
    return all(_equal(x, y) for x, y in pairs if isinstance(x, torch.Tensor))


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return torch.equal(x, y)
    nan = x.isnan()
    return torch.equal(nan, y.isnan()) and torch.equal(x[~nan], y[~nan])


@contextmanager
def replaying(
    model: nn.Module,
    forward: Callable[[Any], Any],
    inputs: Any,
    sites: Sequence[tuple[str, Literal["output", "input"]]],
    hooked: set[int],
) -> Iterator[tuple[Any, list[dict[tuple[int, int], Any]] | None, Replay | None]]:
    """Trace ``inputs``, plan replay for each site, check it; yields (traced output, plans or None, replay or None).

    Plans are None when replay cannot be used (see the module documentation); ``forward`` runs the model.
    """
    trace = CallLog(model, forward, inputs)
    if not trace.calls or trace.random or global_hooks_registered():
        yield trace.output, None, None
        return
    times = [trace.site(name, site) for name, site in sites]
    plans = plan_sites(trace, times, hooked)
    latest = plans[max(range(len(plans)), key=lambda i: times[i] or -1)] if plans else {}
    modules = [c.module for c in trace.calls if any((id(c.module), c.index) in p for p in plans)]
    del trace.calls  # only the chosen outputs stay alive
    if not modules:
        yield trace.output, None, None
        return
    with Replay(model, modules) as replay:
        replay.use(latest)
        try:
            problem = None if same_output(forward(inputs), trace.output) else "did not reproduce the model's output"
        except Exception as exc:  # a replayed call's side effect that later code needs
            problem = f"made the model fail ({exc})"
        replay.use({})
        if problem:
            warn(
                f"activation_patching: replaying the module calls that finish before a site {problem}: a module "
                "with state or side effects? The sweep runs every call instead (reuse=False skips this check)",
                RuntimeWarning,
            )
            yield trace.output, None, None
            return
        yield trace.output, plans, replay
