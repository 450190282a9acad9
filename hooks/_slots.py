"""Per-module dispatch: one PyTorch hook per (manager, module, phase) that runs the manager's hooks in order.

A :class:`ModuleSlot` belongs to one manager and one module. It installs at most two PyTorch hooks on the module
(a forward pre-hook and a forward hook, both ``with_kwargs=True``) whose callables are :class:`Dispatch` objects.
A ``Dispatch`` holds only a weak reference to its slot, so a module never keeps a manager alive, and a manager that
is garbage-collected turns its dispatchers into no-ops before its finaliser removes them.

Modules that carry a ``Dispatch`` also get an instance attribute ``__getstate__`` (a :class:`StateFilter`) that
leaves our hooks out of ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save``; it is deleted when the
module carries no ``Dispatch`` any more.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from ._errors import HookError

if TYPE_CHECKING:
    from .manager import HookHandle

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_ID_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_MAX_PENDING = 64  # stale backward records kept per thread when a forward raised between the two phases


class Dispatch:
    """The callable registered on a module: forwards to its slot while the slot (and so its manager) lives."""

    __slots__ = ("__weakref__", "phase", "slot_ref")

    def __init__(self, slot: ModuleSlot | RunState, phase: str) -> None:
        self.slot_ref: weakref.ref[Any] = weakref.ref(slot)
        self.phase = phase

    @torch.compiler.disable
    def __call__(self, module: nn.Module, *args: Any) -> Any:
        slot = self.slot_ref()
        if slot is None:
            return None
        if self.phase == "pre":
            return slot.run_pre(module, *args)
        if self.phase == "forward":
            return slot.run_forward(module, *args)
        if self.phase == "root-pre":  # a forward of the manager's model starts: call indices restart
            if slot.active == 0:
                slot.run += 1
            slot.active += 1
        else:  # "root-post", registered with always_call: also runs when the forward raises
            slot.active = max(0, slot.active - 1)
        return None

    def __repr__(self) -> str:
        slot = self.slot_ref()
        where = repr(getattr(slot, "name", "the model")) if slot is not None else "a released manager"
        return f"<hookscope {self.phase} dispatch for {where}>"


class RunState(threading.local):
    """Per thread: which forward of the manager's model this is, and how many are in progress.

    A module's call index restarts with each forward of the model; a call made outside any (a submodule called on
    its own, or a manager without a model) is numbered 0.
    """

    run = 0
    active = 0


class StateFilter:
    """Instance-level ``__getstate__`` that drops every :class:`Dispatch` from the state a copy or pickle sees."""

    __slots__ = ("module_ref",)

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def __call__(self) -> dict[str, Any]:
        module = self.module_ref()
        if module is None:  # pragma: no cover - the attribute lives in the module's own __dict__
            raise HookError("the module this state filter belongs to no longer exists")
        state = dict(type(module).__getstate__(module))
        state.pop("__getstate__", None)
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


def install_state_filter(module: nn.Module) -> None:
    if not isinstance(module.__dict__.get("__getstate__"), StateFilter):
        module.__dict__["__getstate__"] = StateFilter(module)


def _drop_state_filter(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("__getstate__"), StateFilter) and not carries_dispatch(module):
        del module.__dict__["__getstate__"]


class Installed:
    """What a slot put on its module: PyTorch handles and a weak reference to the module, nothing of the manager.

    A manager's finaliser holds these objects (and only these), so it can clean a module without keeping the
    manager alive.
    """

    __slots__ = ("handles", "module_ref")

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)
        self.handles: dict[str, RemovableHandle] = {}

    def release(self) -> None:
        """Remove the PyTorch hooks and, when no manager's dispatcher is left on the module, the state filter."""
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
        module = self.module_ref()
        if module is not None:
            _drop_state_filter(module)


class ModuleSlot:
    """The ordered hooks one manager has on one module, and the (at most) two dispatchers that run them.

    The forward dispatcher is installed the first time the manager needs one on the module (a forward or backward
    hook), the pre-forward dispatcher likewise (a pre-hook, a backward hook, or a hook asking for ``call``); each
    stays at that place among the module's hooks until the slot is empty.
    """

    def __init__(self, module: nn.Module, name: str, runs: RunState) -> None:
        self.name = name
        self.runs = runs
        self._local: threading.local | None = None  # per thread: call counter and calls in progress (when needed)
        self.installed = Installed(module)
        self.pre: tuple[HookHandle, ...] = ()
        self.forward: tuple[HookHandle, ...] = ()
        self.backward: tuple[HookHandle, ...] = ()
        self.count_calls = False  # only counted when a hook asks for `call` or gradients are recorded
        self.copy_inputs = bool(getattr(module, "inplace", False))  # in-place modules overwrite their input
        install_state_filter(module)

    # -- bookkeeping -------------------------------------------------------------------------------------------
    _ATTR: ClassVar[dict[str, str]] = {"forward_pre": "pre", "forward": "forward", "backward": "backward"}

    def entries(self, kind: str) -> tuple[HookHandle, ...]:
        """The handles of ``kind`` in firing order."""
        entries: tuple[HookHandle, ...] = getattr(self, self._ATTR[kind])
        return entries

    def _set(self, kind: str, entries: tuple[HookHandle, ...]) -> None:
        setattr(self, self._ATTR[kind], tuple(sorted(entries, key=lambda h: (-h.group.priority, h.seq))))
        everything = self.pre + self.forward + self.backward
        self.count_calls = bool(self.backward) or any("call" in h._keywords for h in everything)
        if self.count_calls and self._local is None:
            self._local = threading.local()
        module = self.installed.module_ref()
        handles = self.installed.handles
        if module is not None and (self.pre or self.count_calls) and "pre" not in handles:
            handles["pre"] = module.register_forward_pre_hook(Dispatch(self, "pre"), with_kwargs=True)
        if module is not None and (self.forward or self.backward) and "forward" not in handles:
            handles["forward"] = module.register_forward_hook(Dispatch(self, "forward"), with_kwargs=True)

    def add(self, handle: HookHandle) -> None:
        """Insert ``handle`` at its place: group priority, then registration order."""
        self._set(handle.kind, (*self.entries(handle.kind), handle))

    def discard(self, handle: HookHandle) -> bool:
        """Take ``handle`` out. Returns whether the slot is now empty (its dispatchers are then released)."""
        had_backward = bool(self.backward)
        self._set(handle.kind, tuple(h for h in self.entries(handle.kind) if h is not handle))
        if had_backward and not self.backward and self._local is not None:
            self._local = threading.local()  # drop the records of calls left unfinished by an exception
        return not (self.pre or self.forward or self.backward)

    # -- the hot path ------------------------------------------------------------------------------------------
    def _next_index(self) -> int:
        """This call's index among the module's calls in the current forward of the model (see RunState)."""
        runs, local = self.runs, self._local
        if runs.active == 0 or local is None:
            return 0
        if getattr(local, "run", None) != runs.run:
            local.run, local.n = runs.run, 0
        index: int = local.n
        local.n = index + 1
        return index

    def run_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Number the call, run the active forward pre-hooks in order, then prepare its backward record."""
        tracked = self.count_calls
        call = self._next_index() if tracked else 0
        changed = False
        for h in self.pre:
            if h._on if h._shared else getattr(h._local, "on", False):
                result = h._call_pre(module, args, kwargs, self.name, call)
                if result is not None:
                    args, kwargs = result
                    changed = True
        record = None
        if self.backward and torch.is_grad_enabled():
            active = [h for h in self.backward if (h._on if h._shared else getattr(h._local, "on", False))]
            if active:
                record = BackwardCall(module, self.name, call, active)
                new_args, new_kwargs = record.take_inputs(args, kwargs, copy=self.copy_inputs)
                if new_args is not args or new_kwargs is not kwargs:
                    args, kwargs, changed = new_args, new_kwargs, True
        if tracked and self._local is not None:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append((call, record))
            del stack[:-_MAX_PENDING]  # calls whose forward raised never pop theirs
        return (args, kwargs) if changed else None

    def run_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """Run the active forward hooks in order, then hook the outputs of this call for its backward record."""
        call, record = 0, None
        if self.count_calls and self._local is not None:
            stack = self._local.__dict__.get("stack")
            if stack:
                call, record = stack.pop()
        changed = False
        for h in self.forward:
            if h._on if h._shared else getattr(h._local, "on", False):
                if h._plain:
                    result = h._call_target(module, args, output)
                else:
                    result = h._call_forward(module, args, kwargs, output, self.name, call)
                if result is not None:
                    output = result
                    changed = True
        if record is not None and record.module is module:
            new_output, overwritten = record.take_outputs(output)
            if overwritten:
                self.copy_inputs = True
            if new_output is not output:
                output, changed = new_output, True
        return output if changed else None


class BackwardCall:
    """The gradients of one forward call of one module, gathered by tensor hooks, handed to backward hooks once.

    Inputs that require grad are replaced by an alias whose tensor hook sees exactly the gradient that flows through
    this call: a view, or for modules that write into their input (``inplace=True``) a copy whose new value is
    written back into the caller's tensor after the call, which the module then returns as it would have. Outputs
    get tensor hooks registered before any later in-place operation, so they see the gradient of the module's true
    output (see :meth:`take_outputs` for the outputs passed on as copies). The record fires when every input that
    requires grad has its gradient; when some never get one (unused, or cut off by ``torch.autograd.grad``), it
    fires at the end of the backward pass with ``None`` in their place.
    """

    __slots__ = (
        "aliases", "arrived", "call", "expected", "fired", "grad_in", "grad_out", "handles", "inputs", "module",
        "name", "outputs", "queued",
    )  # fmt: skip

    def __init__(self, module: nn.Module, name: str, call: int, handles: list[HookHandle]) -> None:
        self.module = module
        self.name = name
        self.call = call
        self.handles = handles
        self.grad_in: list[torch.Tensor | None] = []
        self.grad_out: list[torch.Tensor | None] = []
        self.expected: set[tuple[str, int]] = set()
        self.arrived: set[tuple[str, int]] = set()
        # (position, weak ref to the alias, its version, the caller's tensor if the alias is a copy): weak, so that a
        # record left behind by a forward that raised does not keep the input's graph alive
        self.aliases: list[tuple[int, weakref.ref[torch.Tensor], int, torch.Tensor | None]] = []
        self.fired = False
        self.queued = False
        self.inputs: tuple[Any, ...] = ()
        self.outputs: tuple[Any, ...] = ()

    def take_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, copy: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Alias the inputs that require grad and hook the aliases; return the (possibly new) args and kwargs."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self.grad_in = [None] * len(leaves)
        if any(h._retain for h in self.handles):
            self.inputs = tuple(leaves)
        replaced = False
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                alias = leaf.clone() if copy else leaf.view_as(leaf)
                alias.register_hook(_Collect(self, "in", i))
                self.aliases.append((i, weakref.ref(alias), alias._version, leaf if copy else None))
                self.expected.add(("in", i))
                leaves[i] = alias
                replaced = True
        if not replaced:
            return args, kwargs
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)

    def take_outputs(self, output: Any) -> tuple[Any, bool]:
        """Hook the output tensors; return the output to pass on and whether the module wrote into an input view.

        A lone output tensor is hooked as it is (a hook registered before a later in-place operation still sees the
        gradient of the value the module returned); a leaf (a parameter returned as is) is hooked through a view,
        so that no hook stays on it. Outputs that are views (which lose their hooks when modified in place), that are
        the module's own input, or that come several at a time (one may have been computed from another inside the
        module) are passed on as copies, so that their gradients come only from what happens after the module.
        """
        written_back: dict[int, torch.Tensor] = {}
        overwritten = []
        for i, ref, version, original in self.aliases:
            alias = ref()
            if alias is None or alias._version == version:
                continue
            if original is None:  # a view: the write reached the caller's tensor, but the view's hook is lost
                overwritten.append(i)
                self.expected.discard(("in", i))
            else:  # a copy: give the caller's tensor the value the module wrote, as without hooks
                original.copy_(alias)
                written_back[id(alias)] = original
        aliases = {id(ref()) for _, ref, _, _ in self.aliases}
        self.aliases = []
        leaves, spec = pytree.tree_flatten(output)
        self.grad_out = [None] * len(leaves)
        tensors = [j for j, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        replaced = False
        for j in tensors:
            leaf = leaves[j]
            if id(leaf) in written_back:  # an in-place module returns the caller's tensor itself
                leaf = leaves[j] = written_back[id(leaf)]
                replaced = True
            elif len(tensors) > 1 or leaf._is_view() or id(leaf) in aliases:
                leaf = leaves[j] = leaf.clone()
                replaced = True
            elif leaf.is_leaf:
                leaf = leaves[j] = leaf.view_as(leaf)
                replaced = True
            leaf.register_hook(_Collect(self, "out", j))
        if any(h._retain for h in self.handles):
            self.outputs = tuple(leaves)
        if overwritten:
            warnings.warn(
                f"module {self.name!r} modified its input in place; grad_input for this call is None at "
                f"position(s) {overwritten}. Later calls copy the input first, so their gradients are complete.",
                RuntimeWarning,
                stacklevel=2,
            )
        if not any(key[0] == "in" for key in self.expected):
            self.expected.update(("out", j) for j in tensors)
        return (pytree.tree_unflatten(leaves, spec) if replaced else output), bool(overwritten)

    def collect(self, side: str, index: int, grad: torch.Tensor) -> None:
        """Store one gradient; fire when the expected ones are in, else at the end of this backward pass."""
        (self.grad_in if side == "in" else self.grad_out)[index] = grad
        self.arrived.add((side, index))
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_pass)
        if not self.fired and self.expected <= self.arrived:
            self.fire()

    def fire(self) -> None:
        """Call every backward hook that was active at forward time (and is not removed) with the gradients."""
        self.fired = True
        grad_in, grad_out = tuple(self.grad_in), tuple(self.grad_out)
        for h in self.handles:
            if not h.removed:
                h._call_backward(self.module, grad_in, grad_out, self.name, self.call, self.inputs, self.outputs)

    def end_of_pass(self) -> None:
        """Fire if still pending, then reset so that another backward pass over the same graph fires again."""
        try:
            if not self.fired:
                self.fire()
        finally:
            self.fired = self.queued = False
            self.arrived = set()
            self.grad_in = [None] * len(self.grad_in)
            self.grad_out = [None] * len(self.grad_out)


class _Collect:
    """Tensor hook that passes one gradient to its record (and never changes it)."""

    __slots__ = ("index", "record", "side")

    def __init__(self, record: BackwardCall, side: str, index: int) -> None:
        self.record, self.side, self.index = record, side, index

    def __call__(self, grad: torch.Tensor) -> None:
        self.record.collect(self.side, self.index, grad)


def release_all(installed: dict[int, Installed]) -> None:
    """Finaliser of a manager: remove everything its slots installed."""
    for item in list(installed.values()):
        item.release()
    installed.clear()
