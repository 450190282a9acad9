"""Exceptions raised by :mod:`hooks`."""

from __future__ import annotations


class HookError(RuntimeError):
    """Misuse of hook state: registering a function twice on a module, using a removed group, a bad return value."""


class ModuleNotFoundInModelError(KeyError):
    """A module name or glob that matches nothing in the model; the message lists the closest names."""

    def __str__(self) -> str:  # KeyError quotes its message; show it as written
        return str(self.args[0]) if self.args else ""
