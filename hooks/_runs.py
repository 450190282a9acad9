"""Which forward of the model a module call belongs to, and which call of the module it is.

A manager with a model numbers each module's calls from 0 within one forward of the model (the *run*). Three things
make this harder than a counter:

* A forward can end without its forward hooks running (KeyboardInterrupt bypasses PyTorch's ``always_call`` hooks;
  a group removed from inside its own hook takes the model's hooks with it). The next forward of the model finds
  the count of forwards in progress stale and starts a new run anyway: it is a nested forward only if another call
  of the model is really on this thread's stack.
* Gradient checkpointing runs parts of the forward again during the backward pass (a *recomputation*). Those calls
  are the calls of the forward they replay: each is matched to the forward call it repeats, so hooks see the same
  call index and the activation of the thread that ran the forward, and records are not taken twice.
* Threads: each thread has its own runs; a recomputation may happen in another thread (an autograd device thread).
"""

from __future__ import annotations

import bisect
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from ._backward import graph_task
from ._compiled import hooks_did_not_run

_HISTORY = 8  # forwards remembered for matching recomputed calls
_CALL_IMPL = nn.Module._call_impl.__code__


@dataclass(eq=False)
class Entry:
    """One module call of a forward: enough to recognise it when checkpointing replays it."""

    slot: object
    call: int
    thread: threading.Thread
    first_input: weakref.ref[torch.Tensor] | None
    storage: int  # data pointer of the first input
    recorded: bool = False  # a backward record was made for it (its forward ran under autograd)
    replayed_in: int = -2  # the backward pass that last replayed it


@dataclass(eq=False)
class Run:
    """The calls of one forward of the model, in the order they started, with each module's positions."""

    thread: threading.Thread
    entries: list[Entry] = field(default_factory=list)
    positions: dict[object, list[int]] = field(default_factory=dict)  # slot -> its entries' positions

    def add(self, entry: Entry) -> None:
        self.positions.setdefault(entry.slot, []).append(len(self.entries))
        self.entries.append(entry)


class _Local(threading.local):
    run: Run | None = None
    depth = 0  # forwards of the model in progress on this thread
    counts: dict[object, int]  # calls so far in this run, per slot
    cursor: tuple[Run, int] | None = None  # the last call matched during a recomputation
    fragile: list[Any]  # backward records whose output hooks a later in-place write may drop
    open: list[Any]  # backward records of this run whose forward started (their inputs are held until it ends)
    dispatched = 0  # module hooks of the manager that ran in this run (checked for compiled models)

    def __init__(self) -> None:
        self.counts = {}
        self.fragile = []
        self.open = []


def first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    """The first positional argument, if it is a tensor."""
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _pointer(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    try:
        return int(t.data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (nested, fake, functorch wrappers)
        return 0


class RunState:
    """Runs and call numbers of one manager, per thread, and the recent runs for recomputations."""

    def __init__(self) -> None:
        self.local = _Local()
        self.history: deque[Run] = deque(maxlen=_HISTORY)
        self.compiled = False  # the model is a torch.compile wrapper: a run where no module hook ran is an error

    # -- the model's forward -----------------------------------------------------------------------------------
    def model_starts(self, model: nn.Module) -> None:
        """A forward of the model starts: a new run, unless it is nested in one that is really in progress."""
        local = self.local
        if local.depth > 0 and not _called_below(model):
            local.depth = 0  # the last forward ended without telling us (interrupted, or our hooks were removed)
        if local.depth == 0 and graph_task() == -1:
            local.run = Run(threading.current_thread())
            local.counts = {}
            local.fragile = []
            local.dispatched = 0
            self._close_records()
            self.history.append(local.run)
        local.depth += 1

    def model_ends(self, model: nn.Module) -> list[Any]:
        """A forward of the model ends; returns the fragile backward records of the run when it is the outermost."""
        local = self.local
        local.depth = max(0, local.depth - 1)
        if local.depth == 0:
            self._close_records(keep=model)
            if self.compiled and local.dispatched == 0:
                raise hooks_did_not_run()
            fragile, local.fragile = local.fragile, []
            return fragile
        return []

    def keep_open(self, record: Any) -> None:
        """Remember a backward record whose forward started, to let go of its inputs if the forward never ends."""
        if self.local.depth > 0:
            self.local.open.append(record)

    def _close_records(self, keep: nn.Module | None = None) -> None:
        """Forwards that raised between their two phases: drop what their records hold of the inputs' graphs.

        When the forward of the model ends, the model's own calls are kept (their forward hooks run after the
        model's last hook): they are closed when the next forward of the model starts.
        """
        records = self.local.open
        self.local.open = [r for r in records if r.module is keep]
        for record in records:
            if record.module is not keep:
                record.forget_inputs()

    def keep_fragile(self, record: Any) -> bool:
        """Remember a backward record to check when the forward of the model ends; whether there is one running."""
        if self.local.depth > 0:
            self.local.fragile.append(record)
            return True
        return False

    # -- module calls --------------------------------------------------------------------------------------------
    def call_of(
        self, slot: object, args: tuple[Any, ...], track: bool
    ) -> tuple[int, threading.Thread, Entry | None, bool]:
        """This call's index, the thread whose activation applies, its entry, and whether it replays a forward call.

        During a backward pass the call is a recomputation (gradient checkpointing): it is matched to the forward
        call it replays, whose entry is returned. Outside a run of the model the entry is ``None``.
        """
        task = graph_task()
        if task != -1:
            entry = self._match(slot, first_tensor(args), task)
            if entry is not None:
                return entry.call, entry.thread, entry, True
            return 0, threading.current_thread(), None, True
        local = self.local
        thread = threading.current_thread()
        if local.depth == 0 or local.run is None or not track:
            return 0, thread, None, False
        index = local.counts.get(slot, 0)
        local.counts[slot] = index + 1
        x = first_tensor(args)
        entry = Entry(slot, index, thread, weakref.ref(x) if x is not None else None, _pointer(x))
        local.run.add(entry)
        return index, thread, entry, False

    def _match(self, slot: object, x: torch.Tensor | None, task: int) -> Entry | None:
        """The forward call a recomputed call replays: same input tensor, else the next call, else the newest."""
        local = self.local
        runs = list(reversed(self.history))
        pointer = _pointer(x)
        if pointer:  # the same (living) tensor as the forward call's input: the checkpoint's own input
            for run in runs:
                for position in reversed(run.positions.get(slot, ())):
                    entry = run.entries[position]
                    if entry.replayed_in != task and entry.storage == pointer:
                        alive = entry.first_input() if entry.first_input is not None else None
                        if alive is not None and _pointer(alive) == pointer:
                            return self._take(run, position, task)
        if local.cursor is not None:  # the calls of one recomputation follow each other as in the forward
            run, after = local.cursor
            positions = run.positions.get(slot, [])
            for position in positions[bisect.bisect_right(positions, after) :]:
                if run.entries[position].replayed_in == task:
                    break
                if not any(e.replayed_in == task for e in run.entries[after + 1 : position]):
                    return self._take(run, position, task)
                break
        for run in runs:  # segments are recomputed last first
            for position in reversed(run.positions.get(slot, ())):
                if run.entries[position].replayed_in != task:
                    return self._take(run, position, task)
        return None

    def _take(self, run: Run, position: int, task: int) -> Entry:
        entry = run.entries[position]
        entry.replayed_in = task
        self.local.cursor = (run, position)
        return entry


def _called_below(model: nn.Module) -> bool:
    """Whether a call of ``model`` other than the innermost one is on this thread's stack."""
    frame: FrameType | None = sys._getframe(1)
    found = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is model:
            found += 1
            if found == 2:
                return True
        frame = frame.f_back
    return False


def in_backward() -> bool:
    """Whether a backward pass is running in this thread (where gradient checkpointing recomputes the forward)."""
    return graph_task() != -1
