"""Managed module hooks: named groups, a fixed order, activation without re-registration, guaranteed cleanup.

The order of hooks on one module is: higher group ``priority`` first, then registration order. Activating or
deactivating a hook never moves it. All forward hooks a manager has on a module run from one PyTorch forward hook,
installed the first time the manager needs one on that module, and all its pre-hooks from one pre-hook, likewise;
relative to hooks registered directly with PyTorch each runs at that position (PyTorch runs a module's hooks in
registration order, after global hooks). With its first module hook, a manager also puts a pre-hook (first in line)
and an always-called hook on the model itself, which restart the call numbers at each forward of the model; they go
with its last module hook.

The registry has one source of truth: each group's handles. Everything a manager answers (``handles()``, ``order()``,
``table()``) is derived from them, and each module's :class:`~hooks._dispatch.ModuleSlot` holds the same handles in
firing order.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal

from torch import nn

from ._compiled import check_not_scripted, is_compiled_wrapper, unwrap_compiled
from ._dispatch import Installed, ModuleSlot, install_model_hooks, release_all
from ._errors import HookError
from ._handle import KINDS, HookHandle, function_name, requested_extras
from ._resolve import ModelIndex, ModuleTarget, resolve
from ._runs import RunState

Kind = Literal["forward", "forward_pre", "backward"]
Threads = Literal["current", "all"]


def _fn_key(fn: Callable[..., Any]) -> Any:
    """How a function is recognised again: by equality where it is hashable (bound methods), else by identity."""
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn


class HookGroup:
    """A named set of hooks that are activated, deactivated and removed together.

    Used as a context manager, the group is removed on exit, also when the body raises or is interrupted. A group can
    be the subject of one ``with`` block at a time: entering it again inside the block raises :class:`HookError`
    (an inner exit would remove the group under the outer block).

    Example:
        >>> import torch
        >>> from hooks import HookManager
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> seen = []
        >>> with HookManager(model).group("shapes") as g:
        ...     _ = g.forward("**", lambda module, args, output, *, name: seen.append((name, tuple(output.shape))))
        ...     _ = model(torch.randn(5, 3))
        >>> seen
        [('0', (5, 4)), ('1', (5, 4)), ('2', (5, 2))]
        >>> model._forward_hooks
        OrderedDict()
    """

    def __init__(self, manager: HookManager, name: str, priority: int, threads: Threads | None) -> None:
        self.manager = manager
        self.name = name
        self.priority = priority
        self.threads = threads  # None: per thread, with a warning when used across threads
        self.removed = False
        self.warned = False  # the cross-thread warning was given
        self._entered = False
        self._handles: dict[HookHandle, None] = {}  # insertion-ordered set
        self._keys: set[tuple[int, str, Any]] = set()  # (module id, kind, function) already in the group

    # -- registration ------------------------------------------------------------------------------------------
    def forward(
        self, target: ModuleTarget, fn: Callable[..., Any], *, with_kwargs: bool = False, activate: bool = True
    ) -> list[HookHandle]:
        """Call ``fn(module, args, output)`` after each forward of every module in ``target``.

        ``fn`` may return a replacement output. With ``with_kwargs=True`` it is called as
        ``fn(module, args, kwargs, output)``. Keyword-only parameters ``name`` and ``call`` receive the module's
        qualified name and the index of this call of the module within the forward of the model.

        Returns:
            One handle per module, in model order.
        """
        return self.manager._register(self, "forward", target, fn, with_kwargs=with_kwargs, activate=activate)

    def forward_pre(
        self, target: ModuleTarget, fn: Callable[..., Any], *, with_kwargs: bool = False, activate: bool = True
    ) -> list[HookHandle]:
        """Call ``fn(module, args)`` before each forward; it may return new args (a non-tuple becomes ``(x,)``).

        With ``with_kwargs=True`` it is called as ``fn(module, args, kwargs)`` and may return ``(args, kwargs)``.
        Keyword-only ``name`` and ``call`` as for :meth:`forward`.
        """
        return self.manager._register(self, "forward_pre", target, fn, with_kwargs=with_kwargs, activate=activate)

    def backward(self, target: ModuleTarget, fn: Callable[..., Any], *, activate: bool = True) -> list[HookHandle]:
        """Call ``fn(module, grad_input, grad_output)`` once per forward call, when its gradients are known.

        ``grad_input[i]`` is the gradient, through this call only, of the i-th input leaf (the tensors of the
        positional arguments, then of the keyword arguments, flattened in order; a tensor passed at several positions
        gets its gradient through the call at the first and zeros at the others, so that they add up to it);
        ``grad_output[j]`` that of the j-th output leaf (a tensor, or the tensors of a tuple, dict or dataclass
        output). ``None`` where no gradient flows. Nothing is inserted between the caller's tensors and the module,
        so parameter gradients are bitwise those of an unobserved run. Unlike ``register_full_backward_hook`` this
        works with an in-place operation in or right after the module, with modules called several times (one call
        per forward call), with gradient checkpointing (recomputed calls are the calls they replay), with inputs
        that do not require grad and with keyword-only calls.

        A hook fires if it was active when the call ran (in the thread that ran it) and still is when the
        gradients arrive. Besides ``name`` and ``call``, it may take keyword-only ``args``, ``kwargs`` and
        ``output``: the call's arguments and output (kept alive until the hook has fired). The hook observes; it
        must return ``None``. The gradient tensors belong to autograd, which may later accumulate into them (as
        ``.grad`` of a leaf): clone what you keep (:class:`Recorder` does).
        """
        return self.manager._register(self, "backward", target, fn, with_kwargs=False, activate=activate)

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def handles(self) -> list[HookHandle]:
        """The group's handles in registration order."""
        return list(self._handles)

    @property
    def active(self) -> bool:
        """Whether any hook of the group fires in this thread."""
        return any(h.is_active() for h in self._handles)

    def activate(self) -> HookGroup:
        """Activate every hook of the group (in this thread unless the group was made with ``threads="all"``)."""
        self._check_live()
        for h in self._handles:
            h.activate()
        return self

    def deactivate(self) -> HookGroup:
        """Deactivate every hook of the group; they keep their places."""
        for h in self._handles:
            h.deactivate()
        return self

    @contextmanager
    def active_context(self) -> Iterator[HookGroup]:
        """Activate the group for a ``with`` block, then give each hook back the state it had (it stays registered)."""
        self._check_live()
        before = [(h, h.is_active()) for h in self._handles]
        self.activate()
        try:
            yield self
        finally:
            for h, was_active in before:
                if not was_active:
                    h.deactivate()

    def remove(self) -> None:
        """Remove every hook of the group and the group itself; idempotent."""
        if not self.removed:
            self.manager._remove(list(self._handles))
            self.removed = True
            self.manager._groups.pop(self.name, None)

    def _discard(self, handle: HookHandle) -> None:
        self.manager._remove([handle])

    def _check_live(self) -> None:
        if self.removed:
            raise HookError(f"hook group {self.name!r} was removed; create it again with manager.group({self.name!r})")

    def __enter__(self) -> HookGroup:
        self._check_live()
        if self._entered:
            raise HookError(
                f"hook group {self.name!r} is already used by an enclosing `with` block, which removes it on exit; "
                "use another group name for the inner block (or its active_context() to switch it on for a while)"
            )
        self._entered = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._entered = False
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._handles)} hook(s)"
        return f"<HookGroup {self.name!r} priority={self.priority} threads={self.threads or 'current'!r} {state}>"


class HookManager:
    """Registry of every hook this object put on a model, with groups, ordering, look-ups and cleanup.

    Args:
        model: the model that names, globs and types are resolved against, and whose forwards number the calls
            of its modules. Optional: without it, targets must be module objects, and every call is call 0.

    The manager is a context manager that removes everything on exit. A manager that is garbage-collected
    without :meth:`remove_all` leaves no hook behind. ``copy.deepcopy(model)``, ``pickle`` and ``torch.save(model)``
    of a hooked model carry none of the manager's hooks.

    Example:
        >>> import torch
        >>> from hooks import HookManager
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        >>> with HookManager(model) as mgr:
        ...     g = mgr.group("double", priority=1)
        ...     _ = g.forward("0", lambda module, args, output: 2 * output)
        ...     print(mgr.table())
        group   priority  kind     module  function  state   #
        double  1         forward  0       <lambda>  active  0
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module or None; got {type(model).__name__}")
        if model is not None:
            check_not_scripted(model, "`model`")
        self.model = model
        self._names = unwrap_compiled(model) if model is not None else None  # what names are resolved against
        self._groups: dict[str, HookGroup] = {}
        self._slots: dict[int, ModuleSlot] = {}
        self._installed: dict[int, Installed] = {}  # all that the finaliser must undo; holds no manager
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._runs = RunState()
        self._model_hooks: Installed | None = None
        self._index = ModelIndex(self._names)
        self._signatures: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._finalizer = weakref.finalize(self, release_all, self._installed)

    # -- groups ------------------------------------------------------------------------------------------------
    def group(self, name: str, priority: int | None = None, *, threads: Threads | None = None) -> HookGroup:
        """Return the group called ``name``, creating it if needed.

        Args:
            name: the group's name.
            priority: hooks of groups with higher priority run first on a module (default 0).
            threads: by default activation is per thread: a group activated in one thread does not fire for
                forwards run by another thread, and a warning says so once when that happens. ``"current"``
                makes it per thread without the warning (two threads sharing a model, each with its own groups);
                ``"all"`` makes activation global (worker threads, ``nn.DataParallel`` replicas).
        """
        if threads not in (None, "current", "all"):
            raise ValueError(f"`threads` must be 'current' or 'all'; got {threads!r}")
        with self._lock:
            existing = self._groups.get(name)
            if existing is not None:
                if (priority is not None and priority != existing.priority) or threads not in (None, existing.threads):
                    raise HookError(
                        f"group {name!r} exists with priority={existing.priority}, threads={existing.threads!r}; "
                        f"asked for priority={priority}, threads={threads!r}. Use another name or remove it first."
                    )
                return existing
            group = HookGroup(self, name, 0 if priority is None else int(priority), threads)
            self._groups[name] = group
            return group

    @property
    def groups(self) -> dict[str, HookGroup]:
        """The live groups by name."""
        return dict(self._groups)

    # -- registration ------------------------------------------------------------------------------------------
    def _register(
        self,
        group: HookGroup,
        kind: str,
        target: ModuleTarget,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool,
        activate: bool,
    ) -> list[HookHandle]:
        group._check_live()
        if not callable(fn):
            raise TypeError(f"`fn` must be callable; got {type(fn).__name__}: {fn!r}")
        pairs = resolve(self._names, target, index=self._index)
        names = ", ".join(repr(n or "<model>") for n, _ in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
        asks = requested_extras(fn, kind, with_kwargs, f"group {group.name!r} on {names}", self._signatures)
        key = _fn_key(fn)
        with self._lock:
            for module_name, module in pairs:  # validate everything before touching anything
                check_not_scripted(module, f"`target` {module_name!r}")
                if (id(module), kind, key) in group._keys:
                    raise HookError(
                        f"{function_name(fn)} is already a {kind} hook on {module_name!r} in group {group.name!r}; "
                        "remove it first, or register it in another group"
                    )
            handles: list[HookHandle] = []
            try:
                for module_name, module in pairs:
                    slot = self._slots.get(id(module))
                    if slot is None:
                        slot = self._slots[id(module)] = ModuleSlot(module, module_name, self._runs)
                        self._installed[id(slot.installed)] = slot.installed
                        self._install_model_hooks()
                    handle = HookHandle(
                        group, kind, module, module_name, fn, with_kwargs=with_kwargs, asks=asks, seq=next(self._seq)
                    )
                    if activate:
                        handle.activate()
                    handles.append(handle)
                    group._handles[handle] = None
                    group._keys.add((id(module), kind, key))
                    slot.add(handle)
            except BaseException:
                self._remove(handles)
                raise
            return handles

    def _install_model_hooks(self) -> None:
        """The model's own hooks, first in line, that restart call numbers at each forward of the model."""
        if self.model is not None and self._model_hooks is None:
            self._runs.compiled = is_compiled_wrapper(self.model)
            self._model_hooks = install_model_hooks(self.model, self._runs)
            self._installed[id(self._model_hooks)] = self._model_hooks

    # -- removal -----------------------------------------------------------------------------------------------
    def _remove(self, handles: list[HookHandle]) -> None:
        with self._lock:
            for h in handles:
                if h.removed:
                    continue
                h.deactivate()
                h.removed = True
                group = h.group
                assert isinstance(group, HookGroup)
                group._handles.pop(h, None)
                group._keys.discard((id(h.module), h.kind, _fn_key(h.fn)))
                slot = self._slots.get(id(h.module))
                if slot is not None and slot.discard(h):
                    del self._slots[id(h.module)]
                    self._installed.pop(id(slot.installed), None)
                    slot.installed.release()
            if not self._slots and self._model_hooks is not None:
                self._installed.pop(id(self._model_hooks), None)
                self._model_hooks.release()
                self._model_hooks = None

    def remove_all(self) -> None:
        """Remove every hook and group of this manager; the model is left with exactly its own hooks."""
        with self._lock:
            for group in list(self._groups.values()):
                group.remove()  # every handle is in a group: this releases every slot and the model's hooks

    def remove_function(self, fn: Callable[..., Any]) -> None:
        """Remove ``fn`` from every module and group it is registered on."""
        key = _fn_key(fn)
        self._remove([h for h in self.handles() if _fn_key(h.fn) == key])

    def remove_module(self, target: ModuleTarget) -> None:
        """Remove every hook on the modules in ``target`` (names, globs, modules, types)."""
        ids = {id(m) for _, m in resolve(self._names, target, index=self._index)}
        self._remove([h for h in self.handles() if id(h.module) in ids])

    # -- look-up -----------------------------------------------------------------------------------------------
    def handles(
        self,
        *,
        group: str | HookGroup | None = None,
        module: ModuleTarget | None = None,
        fn: Callable[..., Any] | None = None,
        kind: str | None = None,
        active: bool | None = None,
    ) -> list[HookHandle]:
        """The registered hooks that match every filter given, in registration order."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}; got {kind!r}")
        group_name = group.name if isinstance(group, HookGroup) else group
        ids = {id(m) for _, m in resolve(self._names, module, index=self._index)} if module is not None else None
        key = _fn_key(fn) if fn is not None else None
        found = [
            h
            for g in self._groups.values()
            if group_name is None or g.name == group_name
            for h in g._handles
            if (ids is None or id(h.module) in ids)
            and (key is None or _fn_key(h.fn) == key)
            and (kind is None or h.kind == kind)
            and (active is None or h.is_active() == active)
        ]
        return sorted(found, key=lambda h: h.seq)

    def order(self, target: ModuleTarget, kind: Kind = "forward") -> list[HookHandle]:
        """The hooks of ``kind`` on one module in the order they fire (active or not)."""
        pairs = resolve(self._names, target, index=self._index)
        if len(pairs) != 1:
            raise ValueError(f"`target` must name exactly one module; it matches {len(pairs)}")
        slot = self._slots.get(id(pairs[0][1]))
        return list(slot.entries(kind)) if slot is not None else []

    def table(self) -> str:
        """A text table of every registered hook: group, priority, kind, module, function, state, order."""
        rows = [("group", "priority", "kind", "module", "function", "state", "#")]
        for h in self.handles():
            state = "active" if h.is_active() else "inactive"
            module = h.module_name or "<model>"
            rows.append((h.group.name, str(h.group.priority), h.kind, module, function_name(h.fn), state, str(h.seq)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __len__(self) -> int:
        return sum(len(g._handles) for g in self._groups.values())

    def __repr__(self) -> str:
        model = type(self.model).__name__ if self.model is not None else "no model"
        return f"<HookManager of {model}: {len(self._groups)} group(s), {len(self)} hook(s)>"

    def __enter__(self) -> HookManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove_all()
