"""Turn user targets (names, globs, module objects, module types) into ``(name, module)`` pairs."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Union

from torch import nn

from ._errors import ModuleNotFoundInModelError

ModuleTarget = Union[str, nn.Module, type, Sequence["ModuleTarget"]]  # noqa: UP007 (a recursive alias needs Union on 3.10)
Target = ModuleTarget  # the name used inside hooks

_GLOB_CHARS = frozenset("*?[")


def module_names(model: nn.Module) -> list[str]:
    """Qualified names of every module in ``model``, in ``named_modules()`` order (the root is ``""``).

    Example:
        >>> import torch
        >>> module_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['', '0', '1']
    """
    return [name for name, _ in model.named_modules(remove_duplicate=False)]


def _close_matches(name: str, names: list[str]) -> list[str]:
    """The names most like ``name``, best first (difflib, as torchcam does)."""
    matches = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if not matches:  # fall back on names sharing the last dotted component
        tail = name.rsplit(".", 1)[-1]
        matches = [n for n in names if n.rsplit(".", 1)[-1] == tail][:3]
    return matches


def close_match_hint(name: str, names: list[str]) -> str:
    """``"did you mean 'a', 'b'?"`` with the names closest to ``name``, or a sentence saying there are none."""
    matches = _close_matches(name, [n for n in names if n])
    return f"did you mean {', '.join(repr(m) for m in matches)}?" if matches else "no similar name exists."


def unknown_name_message(name: str, names: list[str], what: str = "`target`") -> str:
    """An error message for a module name that is not in the model, listing the closest names."""
    hint = close_match_hint(name, names)
    return f"{what} {name!r} is not a module of the model; {hint} (see hooks.module_names(model) for all names)"


def resolve(model: nn.Module | None, target: Target, what: str = "`target`") -> list[tuple[str, nn.Module]]:
    """Resolve ``target`` into a list of distinct ``(qualified_name, module)`` pairs, in model order.

    Args:
        model: the model the names refer to; with ``None`` only module objects are accepted.
        target: a qualified name (``"layer4.1.conv2"``, ``""`` for the model itself), a glob, a module object,
            a module type (every instance), or a list of these. In a glob, ``*`` matches within one dotted part
            (``"layer*"`` is ``layer1`` to ``layer4``, not their children), ``?`` one character of a part,
            ``[...]`` a set of characters, and ``**`` any number of parts (``"**.relu"``: every ``relu`` at any
            depth; ``"**"``: every module but the model itself).
        what: how the argument is named in error messages.

    Returns:
        The pairs, without duplicates. Every element of a list must match something, so that a list
        with one bad entry raises before anything is registered.

    Raises:
        ModuleNotFoundInModelError: a name or glob matches no module (a ``KeyError`` listing the closest names).
        ValueError: a module object is not part of ``model``, or a type matches no module.
        TypeError: a target of another kind.
    """
    found: dict[int, tuple[str, nn.Module]] = {}
    # every path of a module shared between parents is a valid name; the first one is its name
    named = dict(model.named_modules(remove_duplicate=False)) if model is not None else {}
    for name, module in _resolve_one(model, named, target, what):
        found.setdefault(id(module), (name, module))
    if model is None:
        return list(found.values())
    order: dict[int, int] = {}
    for i, m in enumerate(named.values()):
        order.setdefault(id(m), i)
    return sorted(found.values(), key=lambda pair: order[id(pair[1])])


class _Names:
    """``id(module) -> name`` for a model, built on first use (resolving many module objects stays linear)."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        self.named = named
        self._by_id: dict[int, str] | None = None

    def name_of(self, module: nn.Module) -> str | None:
        if self._by_id is None:
            self._by_id = {}
            for n, m in self.named.items():
                self._by_id.setdefault(id(m), n)
        return self._by_id.get(id(module))


def _resolve_one(
    model: nn.Module | None, named: dict[str, nn.Module], target: Target, what: str, names: _Names | None = None
) -> Iterable[tuple[str, nn.Module]]:
    names = names if names is not None else _Names(named)
    if isinstance(target, nn.Module):
        if model is None:
            return [(f"{type(target).__name__}@{id(target):x}", target)]
        name = names.name_of(target)
        if name is not None:
            return [(name, target)]
        raise ValueError(
            f"{what} is a {type(target).__name__} that is not part of the model "
            f"(a {type(model).__name__}); pass one of the model's own modules, or give HookManager the model "
            "it belongs to."
        )
    if isinstance(target, str):
        if model is None:
            raise TypeError(
                f"{what} {target!r} is a name, but this HookManager has no model to look names up in; "
                "create it with HookManager(model), or pass the module object."
            )
        return _resolve_name(named, target, what)
    if isinstance(target, type) and issubclass(target, nn.Module):
        if model is None:
            raise TypeError(f"{what} {target.__name__} is a module type; HookManager(model) needs a model for types.")
        pairs = [(n, m) for n, m in named.items() if isinstance(m, target)]
        if not pairs:
            raise ValueError(f"{what}: the model has no module of type {target.__name__}.")
        return pairs
    if isinstance(target, (list, tuple)):
        if not target:
            raise ValueError(f"{what} is an empty {type(target).__name__}; give at least one module.")
        return [pair for item in target for pair in _resolve_one(model, named, item, what, names)]
    raise TypeError(
        f"{what} must be a module name, a glob, a module, a module type or a list of these; "
        f"got {type(target).__name__}: {target!r}"
    )


def _resolve_name(named: dict[str, nn.Module], name: str, what: str) -> list[tuple[str, nn.Module]]:
    if name in named:
        return [(name, named[name])]
    if _GLOB_CHARS & set(name):
        pattern = glob_to_regex(name)
        pairs = [(n, m) for n, m in named.items() if n and pattern.fullmatch(n)]
        if pairs:
            return pairs
        raise ModuleNotFoundInModelError(
            f"{what} glob {name!r} matches no module of the model; " + _glob_hint(name, list(named))
        )
    raise ModuleNotFoundInModelError(unknown_name_message(name, list(named), what))


def glob_to_regex(glob: str) -> re.Pattern[str]:
    """Compile a module-name glob: ``*`` and ``?`` stay within a dotted part, ``**`` spans parts.

    Example:
        >>> [bool(glob_to_regex(g).fullmatch("layer1.0.relu")) for g in ("layer*", "layer*.*.relu", "**.relu")]
        [False, True, True]
    """
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**.", i):
            out.append(r"(?:.*\.)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif glob[i] == "?":
            out.append(r"[^.]")
            i += 1
        elif glob[i] == "[" and "]" in glob[i + 2 :]:
            end = glob.index("]", i + 2)
            body = glob[i + 1 : end]
            body = body.replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out))


def _glob_hint(pattern: str, names: list[str]) -> str:
    stem = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    near = [n for n in names if n and n.startswith(stem)][:5] if stem else []
    if near:
        return f"names starting with {stem!r}: {', '.join(near)} (see hooks.module_names(model))"
    return "see hooks.module_names(model) for all names."
