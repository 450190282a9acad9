"""One hook function on one module in one group: its activation, its calling convention, its removal.

The dispatchers (:mod:`hooks._dispatch`, :mod:`hooks._backward`) read a handle's ``kind``, ``group`` (priority,
threads, name), ``seq`` (registration order) and ``asks`` (the keyword-only extras the function takes), and call
:meth:`HookHandle.fires` (is it active for a given thread), ``active_elsewhere``, ``invoke`` (call the user's function
with the arguments of its kind, checking what it returns) and ``remove``.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from ._errors import HookError


class Group(Protocol):
    """What a handle needs of its group (:class:`hooks.HookGroup`)."""

    warned: bool

    @property
    def name(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def threads(self) -> str | None: ...
    def _discard(self, handle: HookHandle) -> None: ...


KINDS: tuple[str, ...] = ("forward", "forward_pre", "backward")
EXTRAS: dict[str, tuple[str, ...]] = {  # keyword-only parameters a hook may ask for, by kind
    "forward": ("name", "call"),
    "forward_pre": ("name", "call"),
    "backward": ("name", "call", "args", "kwargs", "output"),
}
_POSITIONAL = {
    ("forward", False): ("module", "args", "output"),
    ("forward", True): ("module", "args", "kwargs", "output"),
    ("forward_pre", False): ("module", "args"),
    ("forward_pre", True): ("module", "args", "kwargs"),
    ("backward", False): ("module", "grad_input", "grad_output"),
}


def function_name(fn: Callable[..., Any]) -> str:
    """A readable name for a hook function."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def requested_extras(
    fn: Callable[..., Any], kind: str, with_kwargs: bool, where: str, cache: weakref.WeakKeyDictionary[Any, Any]
) -> tuple[str, ...]:
    """Check that ``fn`` takes the positional arguments of its kind; return the keyword-only extras it asks for.

    A function that fits is remembered in ``cache`` (weakly: the cache keeps nothing alive), so that registering one
    function on many modules, one at a time, checks it once.

    Raises:
        TypeError: ``fn`` cannot be called that way; the message names ``where`` (group and modules).
    """
    function = getattr(fn, "__func__", fn)  # a bound method: its function, with the instance bound or not
    key = (kind, with_kwargs, function is not fn)
    try:
        known = cache.get(function)
    except TypeError:  # neither hashable nor weakly referable: checked every time
        return _extras(fn, kind, with_kwargs, where)
    if known is not None and key in known:
        extras: tuple[str, ...] = known[key]
        return extras
    extras = _extras(fn, kind, with_kwargs, where)
    try:
        cache.setdefault(function, {})[key] = extras
    except TypeError:
        pass
    return extras


def _extras(fn: Callable[..., Any], kind: str, with_kwargs: bool, where: str) -> tuple[str, ...]:
    params = _POSITIONAL[(kind, with_kwargs)]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the caller
        return ()
    extras = EXTRAS[kind]
    wanted = tuple(
        k for k in extras if k in sig.parameters and sig.parameters[k].kind is inspect.Parameter.KEYWORD_ONLY
    )
    try:
        sig.bind(*params, **dict.fromkeys(wanted, 0))
    except TypeError as exc:
        more = len(sig.parameters) > len(params) and kind != "backward" and not with_kwargs
        raise TypeError(
            f"{where}: a {kind} hook is called as fn({', '.join(params)}), optionally with keyword-only "
            f"{', '.join(f'`{k}`' for k in extras)}, but {function_name(fn)}{sig} cannot take that ({exc}); fix its "
            "parameters" + (" or pass with_kwargs=True." if more else ".")
        ) from None
    return wanted


class HookHandle:
    """One hook function on one module in one group: activate, deactivate or remove it on its own.

    Attributes:
        group: the :class:`HookGroup` it belongs to.
        kind: ``"forward"``, ``"forward_pre"`` or ``"backward"``.
        module: the hooked module.
        module_name: the name it was registered under (a module under two names keeps the one asked for; a made-up
            name without a model).
        fn: the user's function.
        seq: registration order within the manager.
        removed: whether it was removed.
    """

    __slots__ = (
        "__weakref__", "_global", "_on", "_others", "_thread", "asks", "fn", "group", "kind", "module", "module_name",
        "removed", "seq", "with_kwargs",
    )  # fmt: skip

    def __init__(
        self,
        group: Group,
        kind: str,
        module: nn.Module,
        module_name: str,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool,
        asks: tuple[str, ...],
        seq: int,
    ) -> None:
        self.group = group
        self.kind = kind
        self.module = module
        self.module_name = module_name
        self.fn = fn
        self.seq = seq
        self.removed = False
        self.asks = asks
        self._global = group.threads == "all"
        self._on = False  # active everywhere (threads="all" groups only)
        # the threads it is active in (other groups): one, the common case, needs no set for the garbage collector
        self._thread: threading.Thread | None = None
        self._others: set[threading.Thread] | None = None
        self.with_kwargs = with_kwargs

    # -- calling ----------------------------------------------------------------------------------------------
    def invoke(self, module: nn.Module, *args: Any) -> Any:
        """Call the user's function with the arguments of its kind and the extras it asks for.

        ``forward``: ``invoke(module, args, kwargs, output, extras) -> new output or None``; ``forward_pre``:
        ``invoke(module, args, kwargs, extras) -> (args, kwargs) or None``; ``backward``:
        ``invoke(module, grad_input, grad_output, extras)``, where ``extras`` maps every name of ``EXTRAS`` to its
        value for this call (only those in ``asks`` are passed on). ``name`` is the name this handle was registered
        under, also when the manager knows the module under another (a module reachable under two names).

        A method rather than a closure made per handle: registering a hook leaves no function objects for the garbage
        collector to walk.
        """
        *positional, extras = args
        chosen = {k: (self.module_name if k == "name" else extras[k]) for k in self.asks} if self.asks else {}
        kind = self.kind
        if kind == "forward":
            a, kw, output = positional
            return (
                self.fn(module, a, kw, output, **chosen) if self.with_kwargs else self.fn(module, a, output, **chosen)
            )
        if kind == "forward_pre":
            return self._pre(module, positional[0], positional[1], chosen)
        result = self.fn(module, positional[0], positional[1], **chosen)
        if result is not None:
            raise HookError(
                f"{self.describe()} returned {type(result).__name__}; backward hooks observe gradients and must return "
                "None (to change gradients, register a tensor hook on the output in a forward hook)"
            )
        return None

    def _pre(self, module: nn.Module, args: Any, kwargs: Any, chosen: dict[str, Any]) -> Any:
        if self.with_kwargs:
            result = self.fn(module, args, kwargs, **chosen)
            if result is None:
                return None
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
                raise HookError(
                    f"{self.describe()} (with_kwargs=True) must return None or (args, kwargs); "
                    f"got {type(result).__name__}"
                )
            return tuple(result[0]), result[1]
        result = self.fn(module, args, **chosen)
        if result is None:
            return None
        return (result if isinstance(result, tuple) else (result,)), kwargs

    # -- activation --------------------------------------------------------------------------------------------
    def fires(self, thread: threading.Thread) -> bool:
        """Whether the hook fires for a forward call made by ``thread``."""
        return self._on or thread is self._thread or (self._others is not None and thread in self._others)

    def is_active(self) -> bool:
        """Whether the hook fires for forwards run by the calling thread."""
        return self.fires(threading.current_thread())

    @property
    def active(self) -> bool:
        """Same as :meth:`is_active`."""
        return self.is_active()

    def active_elsewhere(self) -> bool:
        """Whether the hook is active in a thread other than the calling one (per-thread groups only)."""
        current = threading.current_thread()
        return any(t is not current for t in (self._thread, *(self._others or ())) if t is not None)

    def activate(self) -> HookHandle:
        """Let the hook fire (in this thread, or in every thread for a ``threads="all"`` group); it keeps its place."""
        if self.removed:
            raise HookError(f"{self.describe()} was removed; register it again")
        thread = threading.current_thread()
        if self._global:
            self._on = True
        elif self._thread is None or self._thread is thread:
            self._thread = thread
        elif self._others is None:
            self._others = {thread}
        else:
            self._others.add(thread)
        return self

    def deactivate(self) -> HookHandle:
        """Stop the hook from firing without unregistering it; :meth:`activate` puts it back at the same place."""
        thread = threading.current_thread()
        if self._global:
            self._on = False
        elif self._thread is thread:
            self._thread = self._others.pop() if self._others else None
        elif self._others is not None:
            self._others.discard(thread)
        return self

    def remove(self) -> None:
        """Unregister the hook; idempotent. The module keeps every hook it had that is not ours."""
        if not self.removed:
            self.group._discard(self)

    def describe(self) -> str:
        """``"forward hook 'fn' of group 'g' on 'layer1'"``, for messages."""
        return _describe(self.kind, self.fn, self.group.name, self.module_name)

    def __repr__(self) -> str:
        state = "removed" if self.removed else ("active" if self.is_active() else "inactive")
        return (
            f"<HookHandle {self.kind} {function_name(self.fn)!r} on {self.module_name or '<model>'!r} "
            f"group={self.group.name!r} #{self.seq} {state}>"
        )

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _describe(kind: str, fn: Callable[..., Any], group: str, module_name: str) -> str:
    label = {"forward": "forward hook", "forward_pre": "forward pre-hook", "backward": "backward hook"}[kind]
    return f"{label} {function_name(fn)!r} of group {group!r} on {module_name or '<model>'!r}"
