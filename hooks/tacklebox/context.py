"""Contexts that run functions on entry and exit and combine with other context managers by ``+``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any


class HookContext:
    """Run ``enter_fns`` on entry and ``exit_fns`` on exit, in order (TackleBox's ``CustomContext``).

    ``context + other`` (``other`` any context manager, e.g. ``torch.no_grad()``) enters this one, then ``other``,
    and exits in the same order, as TackleBox does. If an entry function raises, what was entered is exited.

    Example:
        >>> import torch
        >>> log = []
        >>> with HookContext([lambda: log.append("in")], [lambda: log.append("out")]) + torch.no_grad():
        ...     log.append(torch.is_grad_enabled())
        >>> log
        ['in', False, 'out']
    """

    def __init__(
        self,
        enter_fns: Sequence[Callable[[], Any]] = (),
        exit_fns: Sequence[Callable[..., Any]] = (),
        contexts: Sequence[AbstractContextManager[Any]] = (),
    ) -> None:
        self.enter_fns = list(enter_fns)
        self.exit_fns = list(exit_fns)
        self.contexts = list(contexts)  # other context managers, entered after the functions
        self._entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> HookContext:
        for fn in self.enter_fns:
            fn()
        try:
            for context in self.contexts:
                context.__enter__()
                self._entered.append(context)
        except BaseException as exc:
            self._exit(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exit(*exc)

    def _exit(self, *exc: Any) -> None:
        try:
            for fn in self.exit_fns:
                fn()
        finally:
            entered, self._entered = self._entered, []
            for context in entered:
                context.__exit__(*exc)

    def __add__(self, other: Any) -> HookContext:
        if isinstance(other, HookContext):
            return HookContext(
                self.enter_fns + other.enter_fns, self.exit_fns + other.exit_fns, self.contexts + other.contexts
            )
        if not (hasattr(other, "__enter__") and hasattr(other, "__exit__")):
            raise TypeError(f"can only combine a hook context with a context manager, not {type(other).__name__}")
        return HookContext(self.enter_fns, self.exit_fns, [*self.contexts, other])

    __radd__ = __add__
