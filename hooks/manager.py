"""Managed module hooks: named groups, a fixed order, activation without re-registration, guaranteed cleanup.

The order of hooks on one module is: higher group ``priority`` first, then registration order. Activating or
deactivating a hook never moves it. All forward hooks a manager has on a module run from one PyTorch forward hook,
installed the first time the manager needs one on that module, and all its pre-hooks from one pre-hook, likewise;
relative to hooks registered directly with PyTorch each runs at that position (PyTorch runs a module's hooks in
registration order, after global hooks).
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal

from torch import nn

from ._errors import HookError
from ._resolve import Target, close_match_hint, resolve
from ._slots import Dispatch, Installed, ModuleSlot, RunState, install_state_filter, release_all

Kind = Literal["forward", "forward_pre", "backward"]
KINDS: tuple[str, ...] = ("forward", "forward_pre", "backward")
_CATEGORY = {"forward_hook": "forward", "forward_pre_hook": "forward_pre", "backward_hook": "backward", "all": None}

_SIGNATURES = {
    ("forward", False): ("module", "args", "output"),
    ("forward", True): ("module", "args", "kwargs", "output"),
    ("forward_pre", False): ("module", "args"),
    ("forward_pre", True): ("module", "args", "kwargs"),
    ("backward", False): ("module", "grad_input", "grad_output"),
}


def _fn_key(fn: Callable[..., Any]) -> Any:
    """How a function is recognised again: by equality where it is hashable (bound methods), else by identity."""
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


_KEYWORDS = ("name", "call")


def _keywords(fn: Callable[..., Any], kind: str, with_kwargs: bool) -> tuple[str, ...]:
    """Check that ``fn`` takes the positional arguments of its kind; return the keyword-only extras it asks for."""
    params = _SIGNATURES[(kind, with_kwargs)]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the caller
        return ()
    wanted = tuple(
        k for k in _KEYWORDS if k in sig.parameters and sig.parameters[k].kind is inspect.Parameter.KEYWORD_ONLY
    )
    try:
        sig.bind(*params, **dict.fromkeys(wanted, 0))
    except TypeError as exc:
        more = len(sig.parameters) > len(params) and kind != "backward" and not with_kwargs
        raise TypeError(
            f"a {kind} hook is called as fn({', '.join(params)}), optionally with keyword-only `name` and "
            f"`call`, but {_fn_name(fn)}{sig} cannot take that ({exc}); fix its parameters"
            + (" or pass with_kwargs=True." if more else ".")
        ) from None
    return wanted


_NO_THREADS = threading.local()  # never written to: the per-thread flag of hooks active in all threads


class HookHandle:
    """One hook function on one module in one group: activate, deactivate or remove it on its own.

    Attributes:
        module: the hooked module.
        module_name: its qualified name in the manager's model (or the name it was registered under).
        kind: ``"forward"``, ``"forward_pre"`` or ``"backward"``.
        fn: the user's function.
        group: the :class:`HookGroup` it belongs to.
        hook_fn: the :class:`HookFunction` that wraps ``fn`` (TackleBox style look-ups).
        name: ``"<function name>[<module name>]"``, as in TackleBox.
        seq: registration order within the manager.
    """

    __slots__ = (
        "__weakref__", "_call_target", "_keywords", "_local", "_on", "_plain", "_retain", "_shared", "_with_kwargs",
        "fn", "group", "hook_fn", "kind", "module", "module_name", "name", "removed", "seq",
    )  # fmt: skip

    def __init__(
        self,
        group: HookGroup,
        kind: str,
        module: nn.Module,
        module_name: str,
        fn: Callable[..., Any],
        hook_fn: HookFunction,
        *,
        with_kwargs: bool,
        keywords: tuple[str, ...],
        seq: int,
        adapter: Callable[..., Any] | None = None,
        retain: bool = False,
    ) -> None:
        self.group = group
        self.kind = kind
        self.module = module
        self.module_name = module_name
        self.fn = fn
        self.hook_fn = hook_fn
        self.name = f"{hook_fn.name}[{module_name}]"
        self.seq = seq
        self.removed = False
        self._call_target = adapter if adapter is not None else fn
        self._with_kwargs = with_kwargs
        self._keywords = keywords
        self._plain = not keywords and not with_kwargs  # called as fn(module, args, output) directly
        self._retain = retain
        self._shared = group.threads == "all"
        self._on = False
        self._local = _NO_THREADS if self._shared else threading.local()

    # -- activation ----------------------------------------------------------------------------------------------
    def is_active(self) -> bool:
        """Whether the hook fires for forwards run by the calling thread."""
        return self._on if self._shared else getattr(self._local, "on", False)

    @property
    def active(self) -> bool:
        """Same as :meth:`is_active`."""
        return self.is_active()

    def activate(self) -> HookHandle:
        """Let the hook fire (in this thread, or in all threads for a ``threads="all"`` group); keeps its place."""
        self._check_live()
        if self._shared:
            self._on = True
        else:
            self._local.on = True
        return self

    def deactivate(self) -> HookHandle:
        """Stop the hook from firing without unregistering it; :meth:`activate` puts it back at the same place."""
        if self._shared:
            self._on = False
        else:
            self._local.on = False
        return self

    def remove(self) -> None:
        """Unregister the hook; idempotent. The module keeps every hook it had that is not ours."""
        if not self.removed:
            self.group.manager._remove_handles([self])

    def _check_live(self) -> None:
        if self.removed:
            raise HookError(f"hook {self.name!r} of group {self.group.name!r} was removed; register it again")

    # -- calls from the dispatcher -----------------------------------------------------------------------------
    def _extra(self, name: str, call: int) -> dict[str, Any]:
        if not self._keywords:
            return {}
        values = {"name": name, "call": call}
        return {k: values[k] for k in self._keywords}

    def _call_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any, name: str, call: int) -> Any:
        fn = self._call_target
        extra = self._extra(name, call)
        if self._with_kwargs:
            return fn(module, args, kwargs, output, **extra)
        return fn(module, args, output, **extra)

    def _call_pre(self, module: nn.Module, args: Any, kwargs: Any, name: str, call: int) -> tuple[Any, Any] | None:
        fn = self._call_target
        extra = self._extra(name, call)
        if self._with_kwargs:
            result = fn(module, args, kwargs, **extra)
            if result is None:
                return None
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
                raise HookError(
                    f"forward pre-hook {self.name!r} (with_kwargs=True) must return None or (args, kwargs); "
                    f"got {type(result).__name__}"
                )
            return tuple(result[0]), result[1]
        result = fn(module, args, **extra)
        if result is None:
            return None
        return (result if isinstance(result, tuple) else (result,)), kwargs

    def _call_backward(
        self, module: nn.Module, grad_input: Any, grad_output: Any, name: str, call: int, inputs: Any, outputs: Any
    ) -> None:
        extra = self._extra(name, call)
        if self._retain:
            result = self._call_target(module, grad_input, grad_output, inputs, outputs)
        else:
            result = self._call_target(module, grad_input, grad_output, **extra)
        if result is not None:
            raise HookError(
                f"backward hook {self.name!r} returned {type(result).__name__}; backward hooks observe gradients "
                "and must return None (to change gradients, register a tensor hook on the output in a forward hook)"
            )

    def __repr__(self) -> str:
        state = "removed" if self.removed else ("active" if self.is_active() else "inactive")
        return f"<HookHandle {self.kind} {self.name!r} group={self.group.name!r} #{self.seq} {state}>"

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookFunction:
    """A registered function and the modules it is on (TackleBox's ``HookFunction``).

    Attributes:
        name: its id (``hook_fn_name``, else the function's ``repr``).
        function: the user's function.
        hook_type: ``"forward_hook"``, ``"forward_pre_hook"`` or ``"backward_hook"``.
        module_to_handle: module -> :class:`HookHandle`.
    """

    def __init__(self, function: Callable[..., Any], name: str, hook_type: str, *, persistent: bool = False) -> None:
        self.function = function
        self.name = name
        self.hook_type = hook_type
        self.module_to_handle: dict[nn.Module, HookHandle] = {}
        self.persistent = persistent  # TackleBox-style: kept (with its id) until remove_hook_function
        self.live = 0  # handles of this function not yet removed

    @property
    def handles(self) -> list[HookHandle]:
        """The handles of this function, in registration order."""
        return list(self.module_to_handle.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function."""
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<HookFunction {self.name!r} {self.hook_type} on {len(self.module_to_handle)} module(s)>"


class HookGroup:
    """A named set of hooks that are activated, deactivated and removed together.

    Used as a context manager, the group is removed on exit, also when the body raises or is interrupted.

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

    def __init__(self, manager: HookManager, name: str, priority: int, threads: str) -> None:
        self.manager = manager
        self.name = name
        self.priority = priority
        self.threads = threads
        self.removed = False
        self._handles: dict[HookHandle, None] = {}  # insertion-ordered set
        self._keys: set[tuple[int, str, Any]] = set()  # (module id, kind, function) already in the group

    # -- registration ------------------------------------------------------------------------------------------
    def forward(
        self, target: Target, fn: Callable[..., Any], *, with_kwargs: bool = False, activate: bool = True
    ) -> list[HookHandle]:
        """Call ``fn(module, args, output)`` after each forward of every module in ``target``.

        ``fn`` may return a replacement output. With ``with_kwargs=True`` it is called as
        ``fn(module, args, kwargs, output)``. A keyword-only parameter ``name`` receives the module's qualified name.

        Returns:
            One handle per module, in model order.
        """
        return self.manager._register(self, "forward", target, fn, with_kwargs=with_kwargs, activate=activate)

    def forward_pre(
        self, target: Target, fn: Callable[..., Any], *, with_kwargs: bool = False, activate: bool = True
    ) -> list[HookHandle]:
        """Call ``fn(module, args)`` before each forward; it may return new args (a non-tuple becomes ``(x,)``).

        With ``with_kwargs=True`` it is called as ``fn(module, args, kwargs)`` and may return ``(args, kwargs)``.
        """
        return self.manager._register(self, "forward_pre", target, fn, with_kwargs=with_kwargs, activate=activate)

    def backward(self, target: Target, fn: Callable[..., Any], *, activate: bool = True) -> list[HookHandle]:
        """Call ``fn(module, grad_input, grad_output)`` once per forward call, when its gradients are known.

        ``grad_input[i]`` is the gradient, through this call only, of the i-th input leaf (the tensors of the
        positional arguments, then of the keyword arguments, flattened in order); ``grad_output[j]`` that of the
        j-th output leaf (a tensor, or the tensors of a tuple or dict output). ``None`` where no gradient flows.
        Unlike ``register_full_backward_hook`` this works with an in-place operation right after the module, with
        modules called several times (one call per forward call), with inputs that do not require grad and with
        keyword-only calls. The hook observes; it must return ``None``. The gradient tensors belong to autograd,
        which may later accumulate into them (as ``.grad`` of a leaf): clone what you keep (:class:`Recorder` does).
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
        """Activate the group for a ``with`` block and deactivate it afterwards (it stays registered)."""
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()

    def remove(self) -> None:
        """Remove every hook of the group and the group itself; idempotent."""
        if not self.removed:
            self.manager._remove_handles(list(self._handles))
            self.removed = True
            self.manager._groups.pop(self.name, None)

    def _check_live(self) -> None:
        if self.removed:
            raise HookError(f"hook group {self.name!r} was removed; create it again with manager.group({self.name!r})")

    def __enter__(self) -> HookGroup:
        self._check_live()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._handles)} hook(s)"
        return f"<HookGroup {self.name!r} priority={self.priority} threads={self.threads!r} {state}>"


class HookManager:
    """Registry of every hook this object put on a model, with groups, ordering, look-up tables and cleanup.

    Args:
        model: the model that names, globs and types are resolved against. Optional: without it, targets must
            be module objects (as in TackleBox).

    The manager is a context manager that removes everything on exit. A manager that is garbage-collected
    without :meth:`remove_all` leaves no hook behind. ``copy.deepcopy(model)`` and ``torch.save(model)`` of a
    hooked model carry none of the manager's hooks.

    Example:
        >>> import torch
        >>> from hooks import HookManager
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        >>> with HookManager(model) as mgr:
        ...     g = mgr.group("double", priority=1)
        ...     _ = g.forward("0", lambda module, args, output: 2 * output)
        ...     print([h.name for h in mgr.handles()])
        ['<lambda>[0]']
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module or None; got {type(model).__name__}")
        self.model = model
        self._groups: dict[str, HookGroup] = {}
        self._slots: dict[int, ModuleSlot] = {}
        self._installed: dict[int, Installed] = {}  # all that the finaliser must undo; holds no manager
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._runs = RunState()
        self._root: Installed | None = None
        # TackleBox look-up tables
        self.name_to_module: dict[str, nn.Module] = {}
        self.name_to_hookfn: dict[str, HookFunction] = {}
        self.name_to_hookhandle: dict[str, HookHandle] = {}
        self.function_to_hookfn: dict[Callable[..., Any], HookFunction] = {}
        self._module_names: dict[int, str] = {}
        self._named_by_us: dict[int, nn.Module] = {}  # modules whose ``name`` attribute we set (TackleBox)
        self._finalizer = weakref.finalize(self, release_all, self._installed)

    # -- groups ------------------------------------------------------------------------------------------------
    def group(
        self, name: str, priority: int | None = None, *, threads: Literal["current", "all"] | None = None
    ) -> HookGroup:
        """Return the group called ``name``, creating it if needed.

        Args:
            name: the group's name.
            priority: hooks of groups with higher priority run first on a module (default 0).
            threads: ``"current"`` (default) makes activation per thread: a group activated in one thread does
                not fire for forwards run by another thread. ``"all"`` makes activation global (needed for
                ``nn.DataParallel`` replicas, which run in worker threads).
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
            group = HookGroup(self, name, 0 if priority is None else int(priority), threads or "current")
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
        target: Target | None,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool,
        activate: bool,
        hook_fn_name: str | None = None,
        named: list[tuple[str, nn.Module]] | None = None,
        adapter: Callable[..., Any] | None = None,
        retain: bool = False,
    ) -> list[HookHandle]:
        group._check_live()
        if not callable(fn):
            raise TypeError(f"`fn` must be callable; got {type(fn).__name__}: {fn!r}")
        keywords = _keywords(fn, kind, with_kwargs) if adapter is None else ()
        if named is None and target is None:
            raise TypeError("`target` is required: a module name, glob, module, module type or a list of these")
        pairs = named if named is not None else resolve(self.model, target)  # type: ignore[arg-type]
        with self._lock:
            for module_name, module in pairs:  # validate everything before touching anything
                if (id(module), kind, _fn_key(fn)) in group._keys:
                    raise HookError(
                        f"{_fn_name(fn)} is already a {kind} hook on {module_name!r} in group {group.name!r}; "
                        "remove it first, or register it in another group"
                    )
            compat = adapter is not None
            hook_fn = self._hook_function(fn, kind, hook_fn_name or (None if compat else _fn_name(fn)), compat)
            handles = []
            try:
                for module_name, module in pairs:
                    name = self._module_names.setdefault(id(module), module_name)
                    self.name_to_module.setdefault(name, module)
                    handle = HookHandle(
                        group,
                        kind,
                        module,
                        name,
                        fn,
                        hook_fn,
                        with_kwargs=with_kwargs,
                        keywords=keywords,
                        seq=next(self._seq),
                        adapter=adapter,
                        retain=retain,
                    )
                    if activate:
                        handle.activate()
                    slot = self._slots.get(id(module))
                    if slot is None:
                        slot = self._slots[id(module)] = ModuleSlot(module, name, self._runs)
                        self._installed[id(slot.installed)] = slot.installed
                        self._install_root_tick()
                    handles.append(handle)
                    slot.add(handle)
                    group._handles[handle] = None
                    group._keys.add((id(module), kind, _fn_key(fn)))
                    hook_fn.module_to_handle[module] = handle
                    hook_fn.live += 1
                    self.name_to_hookhandle[handle.name] = handle
            except BaseException:
                self._remove_handles(handles)
                if hook_fn.live == 0 and not hook_fn.persistent:
                    self._forget_function(hook_fn)
                raise
            if not handles and not hook_fn.persistent:
                self._forget_function(hook_fn)
            return handles

    def _install_root_tick(self) -> None:
        """A pre-hook on the model, first in line, that restarts call indices at each forward of the model."""
        if self.model is not None and self._root is None:
            self._root = Installed(self.model)
            self._root.handles["root-pre"] = self.model.register_forward_pre_hook(
                Dispatch(self._runs, "root-pre"), prepend=True
            )
            self._root.handles["root-post"] = self.model.register_forward_hook(
                Dispatch(self._runs, "root-post"), always_call=True
            )
            install_state_filter(self.model)
            self._installed[id(self._root)] = self._root

    def _release_root_tick(self) -> None:
        if self._root is not None and not self._slots:
            self._installed.pop(id(self._root), None)
            self._root.release()
            self._root = None

    def _hook_function(self, fn: Callable[..., Any], kind: str, name: str | None, persistent: bool) -> HookFunction:
        hook_type = f"{kind}_hook"
        existing = self.function_to_hookfn.get(_fn_key(fn))
        if existing is not None:
            existing.persistent |= persistent
            return existing
        name = name or repr(fn)
        while name in self.name_to_hookfn:  # TackleBox: a taken id gets a numeric suffix
            stem, _, count = name.rpartition("_")
            name = f"{stem}_{int(count) + 1}" if stem and count.isdigit() else f"{name}_1"
        hook_fn = HookFunction(fn, name, hook_type, persistent=persistent)
        self.function_to_hookfn[_fn_key(fn)] = hook_fn
        self.name_to_hookfn[name] = hook_fn
        return hook_fn

    def _forget_function(self, hook_fn: HookFunction) -> None:
        if self.function_to_hookfn.get(_fn_key(hook_fn.function)) is hook_fn:
            del self.function_to_hookfn[_fn_key(hook_fn.function)]
        if self.name_to_hookfn.get(hook_fn.name) is hook_fn:
            del self.name_to_hookfn[hook_fn.name]

    # -- removal -----------------------------------------------------------------------------------------------
    def _remove_handles(self, handles: list[HookHandle]) -> None:
        with self._lock:
            for h in handles:
                if h.removed:
                    continue
                h.deactivate()
                h.removed = True
                h.group._handles.pop(h, None)
                h.group._keys.discard((id(h.module), h.kind, _fn_key(h.fn)))
                if h.hook_fn.module_to_handle.get(h.module) is h:
                    del h.hook_fn.module_to_handle[h.module]
                h.hook_fn.live -= 1
                if h.hook_fn.live == 0 and not h.hook_fn.persistent:
                    self._forget_function(h.hook_fn)
                if self.name_to_hookhandle.get(h.name) is h:
                    del self.name_to_hookhandle[h.name]
                slot = self._slots.get(id(h.module))
                if slot is not None and slot.discard(h):
                    del self._slots[id(h.module)]
                    self._installed.pop(id(slot.installed), None)
                    slot.installed.release()
            self._release_root_tick()

    def remove_all(self) -> None:
        """Remove every hook and group of this manager; the model is left with exactly its own hooks."""
        with self._lock:
            for group in list(self._groups.values()):
                group.remove()  # every handle is in a group: this releases every slot and the root hooks
            for module in self._named_by_us.values():
                module.__dict__.pop("name", None)
            self._named_by_us.clear()

    close = remove_all

    def remove_function(self, fn: Callable[..., Any]) -> None:
        """Remove ``fn`` from every module and group it is registered on."""
        key = _fn_key(fn)
        self._remove_handles([h for h in self.handles() if _fn_key(h.fn) == key])

    def remove_module(self, target: Target) -> None:
        """Remove every hook on the modules in ``target`` (names, globs, modules, types)."""
        ids = {id(m) for _, m in resolve(self.model, target)}
        self._remove_handles([h for h in self.handles() if id(h.module) in ids])

    # -- look-up -----------------------------------------------------------------------------------------------
    def handles(
        self,
        *,
        group: str | HookGroup | None = None,
        module: Target | None = None,
        fn: Callable[..., Any] | None = None,
        kind: str | None = None,
        active: bool | None = None,
    ) -> list[HookHandle]:
        """The registered hooks that match every filter given, in registration order."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}; got {kind!r}")
        group_name = group.name if isinstance(group, HookGroup) else group
        ids = {id(m) for _, m in resolve(self.model, module)} if module is not None else None
        found = [h for g in self._groups.values() for h in g._handles]
        found = [
            h
            for h in found
            if (group_name is None or h.group.name == group_name)
            and (ids is None or id(h.module) in ids)
            and (fn is None or _fn_key(h.fn) == _fn_key(fn))
            and (kind is None or h.kind == kind)
            and (active is None or h.is_active() == active)
        ]
        return sorted(found, key=lambda h: h.seq)

    def order(self, target: Target, kind: Kind = "forward") -> list[HookHandle]:
        """The hooks of ``kind`` on one module in the order they fire (active or not)."""
        pairs = resolve(self.model, target)
        if len(pairs) != 1:
            raise ValueError(f"`target` must name exactly one module; it matches {len(pairs)}")
        slot = self._slots.get(id(pairs[0][1]))
        return list(slot.entries(kind)) if slot is not None else []

    def table(self) -> str:
        """A text table of every registered hook: group, priority, kind, module, function, state, order."""
        rows = [("group", "priority", "kind", "module", "function", "state", "#")]
        for h in self.handles():
            state = "active" if h.is_active() else "inactive"
            rows.append(
                (
                    h.group.name,
                    str(h.group.priority),
                    h.kind,
                    h.module_name or "<model>",
                    h.hook_fn.name,
                    state,
                    str(h.seq),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __len__(self) -> int:
        return len(self.handles())

    def __repr__(self) -> str:
        model = type(self.model).__name__ if self.model is not None else "no model"
        return f"<HookManager of {model}: {len(self._groups)} group(s), {len(self)} hook(s)>"

    def __enter__(self) -> HookManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove_all()

    # ============================ TackleBox-compatible API =====================================================
    # Every call below has TackleBox's name and arguments. Hooks registered through it live in the group
    # "default" (priority 0, active in all threads as in TackleBox); forward hooks see ``outputs`` as a tuple and
    # return a tuple, as in TackleBox.

    @property
    def modules(self) -> set[nn.Module]:
        """The modules that carry at least one hook of this manager."""
        return {h.module for h in self.handles()}

    @property
    def hook_fns(self) -> set[HookFunction]:
        """Every :class:`HookFunction` known to the manager."""
        return set(self.name_to_hookfn.values())

    @property
    def module_to_hookhandle(self) -> dict[nn.Module, list[HookHandle]]:
        """Module -> its handles, in registration order."""
        table: dict[nn.Module, list[HookHandle]] = {}
        for h in self.handles():
            table.setdefault(h.module, []).append(h)
        return table

    def register_hook(
        self,
        hook_type: str,
        function: Callable[..., Any],
        *modules: nn.Module,
        hook_fn_name: str | None = None,
        activate: bool = True,
        retain_forward_cache: bool = False,
        **named_modules: nn.Module,
    ) -> list[HookHandle]:
        """Register ``function`` as a ``hook_type`` (``"forward_hook"``...) on the given modules (TackleBox)."""
        kind = _CATEGORY.get(hook_type)
        if kind is None:
            raise ValueError(
                f"`hook_type` must be 'forward_hook', 'forward_pre_hook' or 'backward_hook'; got {hook_type!r}"
            )
        if retain_forward_cache and kind != "backward":
            raise ValueError("`retain_forward_cache` is only for backward hooks")
        group = self.group("default", threads="all")  # TackleBox's hooks fire in every thread
        named = self._compat_names(modules, named_modules)
        if not named:  # TackleBox allows naming a function before attaching it anywhere
            with self._lock:
                self._hook_function(function, kind, hook_fn_name, True)
            return []
        adapter = _tacklebox_adapter(kind, function, retain_forward_cache)
        handles = self._register(
            group,
            kind,
            None,
            function,
            with_kwargs=False,
            activate=activate,
            hook_fn_name=hook_fn_name,
            named=named,
            adapter=adapter,
            retain=retain_forward_cache,
        )
        for module_name, module in named:
            if not hasattr(module, "name"):  # TackleBox hooks read module.name
                module.__dict__["name"] = module_name
                self._named_by_us[id(module)] = module
        return handles

    def _compat_names(
        self, modules: tuple[nn.Module, ...], named_modules: dict[str, nn.Module]
    ) -> list[tuple[str, nn.Module]]:
        pairs: list[tuple[str, nn.Module]] = []
        for module in modules:
            name = self._module_names.get(id(module))
            if name is None:
                name = resolve(self.model, module)[0][0] if self.model is not None else repr(module)
            pairs.append((name, module))
        for name, module in named_modules.items():
            if not isinstance(module, nn.Module):
                raise TypeError(f"module `{name}` must be a torch.nn.Module; got {type(module).__name__}")
            if self.model is not None:
                resolve(self.model, module, what=f"module `{name}`")
            known = self._module_names.get(id(module))
            pairs.append((known or name, module))
        return pairs

    def register_forward_hook(
        self,
        function: Callable[..., Any],
        *modules: nn.Module,
        hook_fn_name: str | None = None,
        activate: bool = True,
        **named_modules: Any,
    ) -> list[HookHandle]:
        """TackleBox: register a forward hook ``function(module, inputs, outputs)``; outputs is a tuple."""
        return self.register_hook(
            "forward_hook", function, *modules, hook_fn_name=hook_fn_name, activate=activate, **named_modules
        )

    def register_forward_pre_hook(
        self,
        function: Callable[..., Any],
        *modules: nn.Module,
        hook_fn_name: str | None = None,
        activate: bool = True,
        **named_modules: Any,
    ) -> list[HookHandle]:
        """TackleBox: register a forward pre-hook ``function(module, inputs)``."""
        return self.register_hook(
            "forward_pre_hook", function, *modules, hook_fn_name=hook_fn_name, activate=activate, **named_modules
        )

    def register_backward_hook(
        self,
        function: Callable[..., Any],
        *modules: nn.Module,
        hook_fn_name: str | None = None,
        activate: bool = True,
        retain_forward_cache: bool = False,
        **named_modules: Any,
    ) -> list[HookHandle]:
        """TackleBox: register a backward hook ``function(module, grad_in, grad_out)``.

        With ``retain_forward_cache=True`` it also receives ``inputs, outputs``. ``grad_in``/``grad_out`` line up
        with the inputs/outputs (see :meth:`HookGroup.backward`).
        """
        return self.register_hook(
            "backward_hook",
            function,
            *modules,
            hook_fn_name=hook_fn_name,
            activate=activate,
            retain_forward_cache=retain_forward_cache,
            **named_modules,
        )

    def get_module_hooks(
        self,
        module: nn.Module,
        hook_types: Any = (),
        category: str = "all",
        include_active: bool = True,
        include_inactive: bool = True,
    ) -> Iterator[HookHandle]:
        """TackleBox: the handles on ``module`` filtered by function, category and state."""
        kind = _category(category)
        functions = list(hook_types)
        for h in self.handles():
            if h.module is not module or (kind is not None and h.kind != kind):
                continue
            if functions and not any(h.fn is f for f in functions):
                continue
            if (h.is_active() and include_active) or (not h.is_active() and include_inactive):
                yield h

    def is_module_hooked(self, module: nn.Module) -> bool:
        """TackleBox: whether ``module`` has an active hook of this manager."""
        return any(True for _ in self.get_module_hooks(module, include_inactive=False))

    def _set_active(self, modules: Any, hook_types: Any, category: str, on: bool) -> None:
        for module in modules:
            for h in list(self.get_module_hooks(module, hook_types=hook_types, category=category)):
                h.activate() if on else h.deactivate()

    def activate_module_hooks(self, *modules: nn.Module, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: activate the hooks on ``modules`` (filtered by function and category)."""
        self._set_active(modules, hook_types, category, True)

    def deactivate_module_hooks(self, *modules: nn.Module, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: deactivate the hooks on ``modules`` (filtered by function and category)."""
        self._set_active(modules, hook_types, category, False)

    def activate_module_hooks_by_name(self, *module_names: str, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: :meth:`activate_module_hooks` by registered module names."""
        self.activate_module_hooks(*self._modules_by_name(module_names), hook_types=hook_types, category=category)

    def deactivate_module_hooks_by_name(self, *module_names: str, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: :meth:`deactivate_module_hooks` by registered module names."""
        self.deactivate_module_hooks(*self._modules_by_name(module_names), hook_types=hook_types, category=category)

    def activate_all_hooks(self, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: activate every hook (filtered by function and category)."""
        self._set_active(self.modules, hook_types, category, True)

    activate_all_hook = activate_all_hooks  # the spelling TackleBox's README uses once

    def deactivate_all_hooks(self, hook_types: Any = (), category: str = "all") -> None:
        """TackleBox: deactivate every hook (filtered by function and category)."""
        self._set_active(self.modules, hook_types, category, False)

    def activate_hook_by_name(self, hook_name: str) -> None:
        """TackleBox: activate the handle called ``"fn[module]"``."""
        self._handle_by_name(hook_name).activate()

    def deactivate_hook_by_name(self, hook_name: str) -> None:
        """TackleBox: deactivate the handle called ``"fn[module]"``."""
        self._handle_by_name(hook_name).deactivate()

    @contextmanager
    def hook_module_context(self, *modules: nn.Module, hook_types: Any = (), category: str = "all") -> Iterator[None]:
        """TackleBox: hooks on ``modules`` are active inside the ``with`` block and inactive after it."""
        self.activate_module_hooks(*modules, hook_types=hook_types, category=category)
        try:
            yield
        finally:
            self.deactivate_module_hooks(*modules, hook_types=hook_types, category=category)

    def hook_module_context_by_name(self, *module_names: str, hook_types: Any = (), category: str = "all") -> Any:
        """TackleBox: :meth:`hook_module_context` by registered module names."""
        return self.hook_module_context(*self._modules_by_name(module_names), hook_types=hook_types, category=category)

    def hook_all_context(self, hook_types: Any = (), category: str = "all") -> Any:
        """TackleBox: every hook is active inside the ``with`` block and inactive after it."""
        _category(category)
        return self.hook_module_context(*self.modules, hook_types=hook_types, category=category)

    def remove_hook(self, handle: HookHandle) -> None:
        """TackleBox: remove one handle."""
        handle.remove()

    def remove_hook_by_name(self, handle_name: str) -> None:
        """TackleBox: remove the handle called ``"fn[module]"``."""
        self._handle_by_name(handle_name).remove()

    def remove_hook_function(self, function: Callable[..., Any]) -> None:
        """TackleBox: remove ``function`` from every module and forget it."""
        hook_fn = self.function_to_hookfn.get(_fn_key(function))
        if hook_fn is None:
            raise KeyError(f"{_fn_name(function)} is not registered with this manager")
        self.remove_function(function)
        self._forget_function(hook_fn)

    def remove_hook_function_by_name(self, hook_fn_name: str) -> None:
        """TackleBox: :meth:`remove_hook_function` by the function's id."""
        self.remove_hook_function(self._lookup(self.name_to_hookfn, hook_fn_name, "hook function").function)

    def remove_module_by_name(self, module_name: str) -> None:
        """TackleBox: remove every hook on the module registered as ``module_name`` and forget the name."""
        module = self._lookup(self.name_to_module, module_name, "module")
        self._remove_handles([h for h in self.handles() if h.module is module])
        del self.name_to_module[module_name]
        self._module_names.pop(id(module), None)
        if self._named_by_us.pop(id(module), None) is not None:
            module.__dict__.pop("name", None)

    def cleanup(self) -> None:
        """TackleBox: remove everything (same as :meth:`remove_all`) and clear the look-up tables."""
        self.remove_all()
        self.name_to_module.clear()
        self.name_to_hookfn.clear()
        self.function_to_hookfn.clear()
        self._module_names.clear()

    def _modules_by_name(self, names: tuple[str, ...]) -> list[nn.Module]:
        return [self._lookup(self.name_to_module, n, "module") for n in names]

    def _handle_by_name(self, name: str) -> HookHandle:
        return self._lookup(self.name_to_hookhandle, name, "hook handle")

    @staticmethod
    def _lookup(table: dict[str, Any], key: str, what: str) -> Any:
        if key in table:
            return table[key]
        raise KeyError(f"{what} {key!r} is not registered; {close_match_hint(key, list(table))}")


def _category(category: str) -> str | None:
    if category not in _CATEGORY:
        raise ValueError(f"`category` must be one of {list(_CATEGORY)}; got {category!r}")
    return _CATEGORY[category]


def _tacklebox_adapter(kind: str, fn: Callable[..., Any], retain_forward_cache: bool) -> Callable[..., Any]:
    """Wrap a TackleBox-style hook: forward hooks see and return outputs as a tuple."""
    if kind == "forward":
        _check_arity(fn, 3, "forward hook fn(module, inputs, outputs)")

        def forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            single = not isinstance(output, tuple)
            result = fn(module, args, (output,) if single else output)
            if result is None:
                return None
            if not isinstance(result, tuple):
                raise HookError(f"TackleBox-style forward hook {_fn_name(fn)} must return None or a tuple of outputs")
            return result[0] if single and len(result) == 1 else result

        return forward
    if kind == "forward_pre":
        _check_arity(fn, 2, "forward pre-hook fn(module, inputs)")
        return fn
    _check_arity(fn, 5 if retain_forward_cache else 3, "backward hook fn(module, grad_in, grad_out[, inputs, outputs])")
    return fn


def _check_arity(fn: Callable[..., Any], n: int, what: str) -> None:
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError as exc:
        raise TypeError(f"a TackleBox {what} must take {n} positional arguments: {exc}") from None
    except ValueError:
        pass
