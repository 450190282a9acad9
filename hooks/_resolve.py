"""Turn user targets (names, globs, module objects, module types) into ``(name, module)`` pairs."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Union

from torch import nn

from ._compiled import check_not_scripted, unwrap_compiled
from ._errors import ModuleNotFoundInModelError

ModuleTarget = Union[str, nn.Module, type, Sequence["ModuleTarget"]]  # noqa: UP007 (a recursive alias needs Union on 3.10)
"""What hooks go on: a module name, a glob, a module object, a module type, or a list of these."""

_GLOB_CHARS = frozenset("*?[")


def module_names(model: nn.Module) -> list[str]:
    """Qualified names of every module in ``model``, in ``named_modules()`` order (the root is ``""``).

    For a ``torch.compile`` wrapper, the names of the module it wraps (those a :class:`HookManager` of it takes).

    Example:
        >>> import torch
        >>> module_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['', '0', '1']
    """
    return [name for name, _ in unwrap_compiled(model).named_modules(remove_duplicate=False)]


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


def resolve(
    model: nn.Module | None, target: ModuleTarget, what: str = "`target`", *, index: ModelIndex | None = None
) -> list[tuple[str, nn.Module]]:
    """Resolve ``target`` into a list of distinct ``(qualified_name, module)`` pairs, in model order.

    Args:
        model: the model the names refer to; with ``None`` only module objects are accepted.
        target: a qualified name (``"layer4.1.conv2"``, ``""`` for the model itself), a glob, a module object,
            a module type (every instance), or a list of these. In a glob, ``*`` matches within one dotted part
            (``"layer*"`` is ``layer1`` to ``layer4``, not their children), ``?`` one character of a part,
            ``[...]`` a set of characters, and ``**`` any number of parts (``"**.relu"``: every ``relu`` at any
            depth; ``"**"``: every module but the model itself).
        what: how the argument is named in error messages.
        index: a :class:`ModelIndex` of ``model`` to reuse between calls (a manager keeps one).

    Returns:
        The pairs, without duplicates. A module that is reachable under several names (one module assigned to two
        parents) is named by the path it was asked by; a glob or type that reaches it twice gives it once, under its
        first name in ``named_modules()`` order. Every element of a list must match something, so that a list with
        one bad entry raises before anything is registered.

    Raises:
        ModuleNotFoundInModelError: a name or glob matches no module (a ``KeyError`` listing the closest names).
        ValueError: a module object is not part of ``model``, a type matches no module, or two names in a list
            are the same module (hooks fire per call of a module, so one name is enough: tell the calls apart with
            the ``call`` keyword).
        TypeError: a target of another kind.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [name for name, _ in resolve(model, ["1", "0"])]
        ['0', '1']
    """
    if model is not None:
        check_not_scripted(model, "`model`")
    index = index if index is not None and index.model is model else ModelIndex(model)
    if isinstance(target, str) and model is not None and not _GLOB_CHARS & set(target):
        return [(target, index.module(target, what))]  # the common case: one name, found by walking its path
    if isinstance(target, (list, tuple)) and len(target) > 1:
        index = index.snapshot()  # one table for the whole list: names of objects and model order
    found: dict[int, tuple[str, nn.Module]] = {}
    explicit: dict[int, str] = {}  # modules asked for by an exact name, for the shared-module check
    for name, module, exact in _resolve_one(model, index, target, what):
        if exact and id(module) in explicit and explicit[id(module)] != name:
            raise ValueError(
                f"{what} names {explicit[id(module)]!r} and {name!r}, which are the same module (a "
                f"{type(module).__name__} shared between two parents): its hooks fire at each of its calls under "
                "either name. Give one of the names, and tell the calls apart with the `call` keyword of the hook."
            )
        if exact:
            explicit.setdefault(id(module), name)
        found.setdefault(id(module), (name, module))
    if model is None or len(found) < 2:
        return list(found.values())
    order: dict[int, int] = {}
    for i, m in enumerate(index.named().values()):
        order.setdefault(id(m), i)
    return sorted(found.values(), key=lambda pair: order[id(pair[1])])


class ModelIndex:
    """Look-ups of a model's modules by name and by object that stay fast when called once per module.

    Names are found by walking their dotted path (``get_submodule``); the name of a module object comes from a table
    built once and checked at every use, rebuilt when the model's structure has changed.
    """

    def __init__(self, model: nn.Module | None, named: dict[str, nn.Module] | None = None) -> None:
        self.model = model
        self._named = named  # a table taken for one resolution (see snapshot), else None: walked at each use
        self._by_id: dict[int, str] | None = None

    def snapshot(self) -> ModelIndex:
        """An index whose tables are taken now and trusted for the rest of one resolution."""
        return ModelIndex(self.model, self.named())

    def named(self) -> dict[str, nn.Module]:
        """Every path to every module (a module under two parents has two), in ``named_modules()`` order."""
        if self._named is not None:
            return self._named
        return dict(self.model.named_modules(remove_duplicate=False)) if self.model is not None else {}

    def module(self, name: str, what: str) -> nn.Module:
        """The module called ``name``, or the error listing the closest names."""
        assert self.model is not None
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            raise ModuleNotFoundInModelError(unknown_name_message(name, list(self.named()), what)) from None

    def name_of(self, module: nn.Module) -> str | None:
        """The first name of ``module`` in the model, or ``None`` when it is not part of it."""
        if self._by_id is not None:
            name = self._by_id.get(id(module))
            if name is not None and (self._named is not None or self._get(name) is module):
                return name
            if self._named is not None:
                return None
        self._by_id = {}
        for n, m in self.named().items():
            self._by_id.setdefault(id(m), n)
        return self._by_id.get(id(module))

    def _get(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name) if self.model is not None else None
        except AttributeError:
            return None


def _resolve_one(
    model: nn.Module | None, index: ModelIndex, target: ModuleTarget, what: str
) -> Iterable[tuple[str, nn.Module, bool]]:
    """``(name, module, asked by exact name or object)`` for one target."""
    if isinstance(target, nn.Module):
        if model is None:
            return [(f"{type(target).__name__}@{id(target):x}", target, False)]
        name = index.name_of(target)
        if name is not None:
            return [(name, target, False)]
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
        if not _GLOB_CHARS & set(target):
            return [(target, index.module(target, what), True)]
        return [(n, m, False) for n, m in _resolve_glob(index.named(), target, what)]
    if isinstance(target, type) and issubclass(target, nn.Module):
        if model is None:
            raise TypeError(f"{what} {target.__name__} is a module type; HookManager(model) needs a model for types.")
        pairs = [(n, m, False) for n, m in index.named().items() if isinstance(m, target)]
        if not pairs:
            raise ValueError(f"{what}: the model has no module of type {target.__name__}.")
        return pairs
    if isinstance(target, (list, tuple)):
        if not target:
            raise ValueError(f"{what} is an empty {type(target).__name__}; give at least one module.")
        return [triple for item in target for triple in _resolve_one(model, index, item, what)]
    raise TypeError(
        f"{what} must be a module name, a glob, a module, a module type or a list of these; "
        f"got {type(target).__name__}: {target!r}"
    )


def _resolve_glob(named: dict[str, nn.Module], name: str, what: str) -> list[tuple[str, nn.Module]]:
    pattern = glob_to_regex(name)
    pairs = [(n, m) for n, m in named.items() if n and pattern.fullmatch(n)]
    if pairs:
        return pairs
    raise ModuleNotFoundInModelError(
        f"{what} glob {name!r} matches no module of the model; " + _glob_hint(name, list(named))
    )


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
