"""Per-module dispatch: one PyTorch hook per (manager, module, phase) that runs the manager's hooks in order.

A :class:`ModuleSlot` belongs to one manager and one module. It installs at most two PyTorch hooks on the module
(a forward pre-hook and a forward hook, both ``with_kwargs=True``) whose callables are :class:`Dispatch` objects.
A ``Dispatch`` holds only a weak reference to its slot, so a module never keeps a manager alive, and a manager that
is garbage-collected turns its dispatchers into no-ops before its finaliser removes them.

Copies never carry our hooks: modules that carry a ``Dispatch`` get a :class:`CopyFilter` as instance ``__getstate__``,
which leaves them out of ``copy.deepcopy``, ``pickle`` and ``torch.save``, and as instance ``__deepcopy__``, which at
copy time takes the route the module's class takes (its own ``__deepcopy__``, as parametrized modules have, or the
default one) and cleans the copy: a class may change after the hooks were registered
(``parametrize.register_parametrization`` gives the module a subclass with a ``__deepcopy__``). A ``Dispatch`` copied
by any other route is inert. Both attributes are deleted when the module carries no ``Dispatch`` any more.
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._backward import BackwardCall
from ._errors import HookError
from ._runs import RunState

if TYPE_CHECKING:
    from ._handle import HookHandle

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_ID_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_FILTERS = ("__getstate__", "__deepcopy__")  # the instance attributes a CopyFilter is set as
_MAX_PENDING = 64  # unfinished calls kept per thread when forwards raised between the two phases


def _outside_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``fn`` out of ``torch.compile`` graphs: run it eagerly, as ``torch.compiler.disable`` does.

    ``torch.compiler.disable`` imports ``torch._dynamo``, which costs more than a second at import time of this package.
    This does what it does, through the C extension only: the wrapper's code is marked as never compiled, it switches
    dynamo's frame evaluation off around the call, and it carries the attribute dynamo reads when tracing a call to
    it (a graph break, then an eager call). Falls back on the decorator in builds without those switches.
    """
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    set_eval_frame = getattr(frames, "set_eval_frame", None)
    skip = _code_skipper(frames)
    if set_eval_frame is None or skip is None:  # pragma: no cover - builds without the C switches
        return torch.compiler.disable(fn)

    @functools.wraps(fn)
    def eager(*args: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            return fn(*args)
        finally:
            if prior is not None:
                set_eval_frame(prior)

    skip(eager.__code__)  # type: ignore[attr-defined]
    eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    return eager


def _code_skipper(frames: Any) -> Callable[[Any], None] | None:
    """The C function that marks a code object as never compiled by dynamo, if this build has one."""
    if hasattr(frames, "set_code_exec_strategy") and hasattr(frames, "_FrameExecStrategy"):
        strategy = frames._FrameExecStrategy(frames._FrameAction.SKIP, frames._FrameAction.DEFAULT)
        return lambda code: frames.set_code_exec_strategy(code, strategy)
    skip: Callable[[Any], None] | None = getattr(frames, "skip_code", None)
    return skip


def _dispatch(self: Dispatch, module: nn.Module, *args: Any) -> Any:
    target = self.target_ref()
    if target is None:
        return None
    if self.phase == "pre":
        return target.run_pre(module, *args)
    if self.phase == "forward":
        return target.run_forward(module, *args)
    if self.phase == "model-pre":  # a forward of the manager's model starts
        target.model_starts(module)
        return None
    lost = [record for record in target.model_ends(module) if record.lost_outputs()]
    if lost:
        _warn_lost(lost)
    return None


class Dispatch:
    """The callable registered on a module: forwards to its slot (or run state) while the manager lives."""

    __slots__ = ("__weakref__", "phase", "target_ref")

    def __init__(self, target: ModuleSlot | RunState | None, phase: str) -> None:
        self.target_ref: Callable[[], Any] = weakref.ref(target) if target is not None else _dead
        self.phase = phase

    __call__ = _outside_compile(_dispatch)

    def __deepcopy__(self, memo: dict[int, Any]) -> Dispatch:
        return Dispatch(None, self.phase)  # a copy never fires the original manager's hooks

    def __copy__(self) -> Dispatch:
        return Dispatch(None, self.phase)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dispatch, (None, self.phase))

    def __repr__(self) -> str:
        target = self.target_ref()
        where = repr(getattr(target, "name", "the model")) if target is not None else "a released manager"
        return f"<hookscope {self.phase} dispatch for {where}>"


def _dead() -> None:
    return None


def _warn_lost(records: list[BackwardCall]) -> None:
    """One warning for every call of one forward whose output hooks an in-place write dropped."""
    names = list(dict.fromkeys(f"{r.name!r}" if r.call == 0 else f"{r.name!r} (call {r.call})" for r in records))
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    warnings.warn(
        f"backward hooks will not fire in this forward for {len(names)} module call(s): {shown}. Each returned a "
        "view of its input (an Identity, a dropout in eval mode) that was then modified in place (an in-place "
        "activation after it); PyTorch drops the tensor hooks of a view written in place (the model's results are "
        "unchanged). Hook the module that writes in place (e.g. the activation) instead, or make it not in place.",
        RuntimeWarning,
        stacklevel=2,
    )


# -- copies and pickles ----------------------------------------------------------------------------------------------
class CopyFilter:
    """Instance-level ``__getstate__`` and ``__deepcopy__`` (one object, both attributes): copies leave us out.

    Called without an argument (``__getstate__``), it returns the module's state without any :class:`Dispatch`;
    called with the ``memo`` (``__deepcopy__``), it makes the copy the module's class makes, looked up at copy time
    (its own ``__deepcopy__``, as parametrized modules have, or the default one), and cleans it.
    """

    __slots__ = ("module_ref",)

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def __call__(self, memo: dict[int, Any] | None = None) -> Any:
        module = self.module_ref()
        if module is None:  # pragma: no cover - the attribute lives in the module itself
            raise HookError("the module this copy filter belongs to no longer exists")
        if memo is None:
            return _without_dispatch(dict(type(module).__getstate__(module)))
        own = getattr(type(module), "__deepcopy__", None)  # looked up now: the class may have changed since
        if own is not None:
            replica: nn.Module = own(module, memo)
        else:  # what copy.deepcopy does for a class without one; the state comes from our __getstate__
            replica = copy._reconstruct(module, memo, *module.__reduce_ex__(4))  # type: ignore[attr-defined]
        replica.__dict__.update(_without_dispatch(replica.__dict__))
        return replica

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyFilter:
        return self  # only reached through a class-level __deepcopy__, which the instance one calls and cleans


def _without_dispatch(state: dict[str, Any]) -> dict[str, Any]:
    """A module state without our dispatchers and without our instance attributes."""
    for attr in _FILTERS:
        if isinstance(state.get(attr), CopyFilter):
            del state[attr]
    dropped: set[int] = set()
    for attr in _HOOK_DICTS:
        hooks = state.get(attr)
        if hooks and any(isinstance(h, Dispatch) for h in hooks.values()):
            kept = OrderedDict((k, h) for k, h in hooks.items() if not isinstance(h, Dispatch))
            dropped.update(set(hooks) - set(kept))
            state[attr] = kept
    for attr in _ID_DICTS:
        ids = state.get(attr)
        if ids and dropped & set(ids):
            state[attr] = OrderedDict((k, v) for k, v in ids.items() if k not in dropped)
    return state


def carries_dispatch(module: nn.Module) -> bool:
    """Whether any hookscope manager has a dispatcher installed on ``module``."""
    return any(isinstance(h, Dispatch) for attr in _HOOK_DICTS for h in getattr(module, attr, {}).values())


def install_copy_filters(module: nn.Module) -> None:
    """Make copies and pickles of ``module`` leave our dispatchers out."""
    if not isinstance(module.__dict__.get("__deepcopy__"), CopyFilter):
        copy_filter = CopyFilter(module)  # one object for both attributes: one fewer for the garbage collector
        module.__dict__.update(dict.fromkeys(_FILTERS, copy_filter))


def _drop_copy_filters(module: nn.Module) -> None:
    if carries_dispatch(module):
        return
    for attr in _FILTERS:
        if isinstance(module.__dict__.get(attr), CopyFilter):
            del module.__dict__[attr]


class Installed:
    """What a slot put on its module: the ids of its PyTorch hooks and a weak reference to the module.

    A manager's finaliser holds these objects (and only these), so it can clean a module without keeping the
    manager alive. The hooks are kept by id, not by PyTorch's ``RemovableHandle`` (an object and three weak
    references each), so that a registration leaves little for the garbage collector to walk.
    """

    __slots__ = ("handles", "module_ref")

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)
        self.handles: dict[str, int] = {}  # str -> int only: a dict the garbage collector does not track

    def add(self, key: str, handle: RemovableHandle) -> None:
        """Keep the id of a hook just registered on the module."""
        self.handles[key] = handle.id

    def release(self) -> None:
        """Remove the PyTorch hooks and, when no manager's dispatcher is left on the module, the copy filters."""
        module = self.module_ref()
        if module is not None:
            for hook_id in self.handles.values():
                for attr in (*_HOOK_DICTS, *_ID_DICTS):
                    getattr(module, attr, {}).pop(hook_id, None)
            _drop_copy_filters(module)
        self.handles.clear()


def install_model_hooks(model: nn.Module, runs: RunState) -> Installed:
    """The pre-hook (first in line) and hook (always called) that tell ``runs`` when a forward of the model starts."""
    installed = Installed(model)
    installed.add("model-pre", model.register_forward_pre_hook(Dispatch(runs, "model-pre"), prepend=True))
    installed.add("model-post", model.register_forward_hook(Dispatch(runs, "model-post"), always_call=True))
    install_copy_filters(model)
    return installed


# -- one module's hooks ----------------------------------------------------------------------------------------------
class _Pending(threading.local):
    """Per thread: the calls of one module whose forward started and has not finished (innermost last)."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, threading.Thread, BackwardCall | None]] = []


class ModuleSlot:
    """The ordered hooks one manager has on one module, and the (at most) two dispatchers that run them.

    The forward dispatcher is installed the first time the manager needs one on the module (a forward or backward
    hook), the pre-forward dispatcher likewise (a pre-hook, or any hook that needs calls numbered); each stays at that
    place among the module's hooks until the slot is empty.
    """

    _ATTR: ClassVar[dict[str, str]] = {"forward_pre": "pre", "forward": "forward", "backward": "backward"}
    __slots__ = ("__weakref__", "_pending", "backward", "forward", "installed", "name", "pre", "runs", "track")

    def __init__(self, module: nn.Module, name: str, runs: RunState) -> None:
        self.name = name
        self.runs = runs
        self.installed = Installed(module)
        self.pre: tuple[HookHandle, ...] = ()
        self.forward: tuple[HookHandle, ...] = ()
        self.backward: tuple[HookHandle, ...] = ()
        self.track = False  # calls are numbered when a hook asks for `call` or there are backward hooks
        self._pending: _Pending | None = None  # made when calls are tracked (one per slot and thread is costly)
        install_copy_filters(module)

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def entries(self, kind: str) -> tuple[HookHandle, ...]:
        """The handles of ``kind`` in firing order."""
        entries: tuple[HookHandle, ...] = getattr(self, self._ATTR[kind])
        return entries

    def _set(self, kind: str, entries: tuple[HookHandle, ...]) -> None:
        setattr(self, self._ATTR[kind], tuple(sorted(entries, key=lambda h: (-h.group.priority, h.seq))))
        everything = self.pre + self.forward + self.backward
        self.track = bool(self.backward) or any("call" in h.asks for h in everything)
        if self.track and self._pending is None:
            self._pending = _Pending()
        module = self.installed.module_ref()
        handles = self.installed.handles
        if module is not None and (self.pre or self.track) and "pre" not in handles:
            self.installed.add("pre", module.register_forward_pre_hook(Dispatch(self, "pre"), with_kwargs=True))
        if module is not None and (self.forward or self.backward) and "forward" not in handles:
            self.installed.add("forward", module.register_forward_hook(Dispatch(self, "forward"), with_kwargs=True))

    def add(self, handle: HookHandle) -> None:
        """Insert ``handle`` at its place: group priority, then registration order."""
        self._set(handle.kind, (*self.entries(handle.kind), handle))

    def discard(self, handle: HookHandle) -> bool:
        """Take ``handle`` out. Returns whether the slot is now empty (its dispatchers are then released)."""
        self._set(handle.kind, tuple(h for h in self.entries(handle.kind) if h is not handle))
        return not (self.pre or self.forward or self.backward)

    # -- the hot path ------------------------------------------------------------------------------------------
    def run_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Number the call, run the active forward pre-hooks in order, then prepare its backward record."""
        call, thread, entry, replay = self.runs.call_of(self, args, self.track)
        if self.runs.compiled:
            self.runs.local.dispatched += 1
        extras = {"name": self.name, "call": call}
        changed = fired = False
        for h in self.pre:
            if h.fires(thread):
                fired = True
                result = h.invoke(module, args, kwargs, extras)
                if result is not None:
                    args, kwargs = result
                    changed = True
        record = None
        if self.backward and torch.is_grad_enabled() and not (replay and entry is not None and entry.recorded):
            active = [h for h in self.backward if h.fires(thread)]
            if active:
                record = BackwardCall(module, self.name, call, active, thread)
                record.take_inputs(args, kwargs)
                self.runs.keep_open(record)
                if entry is not None and not replay:
                    entry.recorded = True  # replays of this call (non-reentrant checkpointing) need no record
            fired = fired or bool(active)
        if not fired and self.pre + self.backward:
            self._check_threads(self.pre + self.backward)
        if self.track and self._pending is not None:
            stack = self._pending.stack
            stack.append((call, thread, record))
            del stack[:-_MAX_PENDING]  # calls whose forward raised never pop theirs
        return (args, kwargs) if changed else None

    def run_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """Run the active forward hooks in order, then hook the outputs of this call for its backward record."""
        if self.runs.compiled:
            self.runs.local.dispatched += 1
        record = None
        if self.track and self._pending is not None and self._pending.stack:
            call, thread, record = self._pending.stack.pop()
        else:
            call, thread = 0, threading.current_thread()
        extras = {"name": self.name, "call": call}
        changed = fired = False
        for h in self.forward:
            if h.fires(thread):
                fired = True
                result = h.invoke(module, args, kwargs, output, extras)
                if result is not None:
                    output = result
                    changed = True
        if not fired and self.forward:
            self._check_threads(self.forward)
        if record is not None and record.module is module:
            new_output = record.take_outputs(output)
            if record.fragile and not self.runs.keep_fragile(record):
                record.fragile = []  # outside a forward of the model there is no end to check at
            if new_output is not output:
                output, changed = new_output, True
        return output if changed else None

    def _check_threads(self, handles: tuple[HookHandle, ...]) -> None:
        """Warn once per group when its hooks do not fire here but are active in another thread (a worker thread)."""
        elsewhere = [h for h in handles if h.group.threads is None and not h.group.warned and h.active_elsewhere()]
        if elsewhere:
            groups = sorted({h.group.name for h in elsewhere})
            for h in elsewhere:
                h.group.warned = True
            warnings.warn(
                f"module {self.name!r} ran in thread {threading.current_thread().name!r}, where the hooks of group(s) "
                f"{groups} are not active; they are active in another thread and fire only there. Activate them in "
                "this thread, or create the group with threads='all' (Recorder, record and patch take threads='all'"
                "); pass threads='current' to keep them per thread without this warning.",
                RuntimeWarning,
                stacklevel=3,
            )


def release_all(installed: dict[int, Installed]) -> None:
    """Finaliser of a manager: remove everything its slots installed."""
    for item in list(installed.values()):
        item.release()
    installed.clear()
