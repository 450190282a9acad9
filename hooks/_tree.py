"""Flatten and rebuild what modules take and return: tensors inside tuples, lists, dicts and dataclasses.

:func:`flatten`, :func:`map_tensors` and :func:`tensors` are public (``hooks.flatten``...): the one tree walker that
``hooks`` and ``attribution`` use for nested inputs and outputs.

PyTorch's ``torch.utils._pytree`` knows tuples, lists, dicts, named tuples and the types registered with it
(HuggingFace registers its ``ModelOutput``); a plain ``@dataclass`` output is a single opaque leaf there. Hooks must
see (and records must copy) the tensors inside those too, so this module treats any dataclass instance that pytree
does not know as a node whose children are its fields.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

_LEAF = None  # the spec of a leaf


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """How to rebuild a flattened value: a pytree node, or a dataclass whose fields are children.

    Two specs are equal when the values have the same structure: the same containers, keys, dataclass types and
    field names (the dataclass objects themselves are not compared).
    """

    node: Any  # a pytree TreeSpec of the value, with dataclasses cut out as leaves
    dataclasses: tuple[tuple[int, Any, tuple[str, ...], tuple[Spec, ...]], ...]  # (leaf index, object, ...)
    sizes: tuple[int, ...]  # leaves each pytree leaf expands into

    def _shape(self) -> tuple[Any, ...]:
        return (self.node, self.sizes, tuple((i, type(obj), names, specs) for i, obj, names, specs in self.dataclasses))

    def __eq__(self, other: object) -> bool:
        """Same structure (see the class docstring)."""
        return isinstance(other, Spec) and self._shape() == other._shape()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        """The pytree spec's repr (dataclass nodes inside it show as leaves)."""
        return repr(self.node)


def _is_plain_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value) not in pytree.SUPPORTED_NODES


def flatten(value: Any) -> tuple[list[Any], Spec]:
    """The leaves of ``value`` (tensors and anything else that is not a container) and how to rebuild it.

    The one walk of nested inputs and outputs in the library: tuples, lists, dicts, named tuples, HuggingFace
    ``ModelOutput`` (every type ``torch.utils._pytree`` knows) and plain dataclasses, whose fields are children.
    Two values have the same structure when their specs are equal.

    Example:
        >>> leaves, spec = flatten({"a": torch.ones(1), "b": (2, torch.zeros(2))})
        >>> [type(x).__name__ for x in leaves], spec == flatten({"a": 0, "b": (1, 2)})[1]
        (['Tensor', 'int', 'Tensor'], True)
    """
    outer, node = pytree.tree_flatten(value, is_leaf=_is_plain_dataclass)
    leaves: list[Any] = []
    nested = []
    sizes = []
    for i, item in enumerate(outer):
        if _is_plain_dataclass(item):
            names = tuple(f.name for f in dataclasses.fields(item))
            specs = []
            start = len(leaves)
            for name in names:
                sub_leaves, sub_spec = flatten(getattr(item, name))
                leaves.extend(sub_leaves)
                specs.append(sub_spec)
            nested.append((i, item, names, tuple(specs)))
            sizes.append(len(leaves) - start)
        else:
            leaves.append(item)
            sizes.append(1)
    return leaves, Spec(node, tuple(nested), tuple(sizes))


def unflatten(leaves: list[Any], spec: Spec) -> Any:
    """Rebuild a value from (possibly replaced) leaves; a dataclass is copied with its changed fields set."""
    if not spec.dataclasses:
        return pytree.tree_unflatten(leaves, spec.node)
    outer: list[Any] = []
    position = 0
    by_index = {i: (obj, names, specs) for i, obj, names, specs in spec.dataclasses}
    for i, size in enumerate(spec.sizes):
        if i in by_index:
            obj, names, specs = by_index[i]
            values = {}
            for name, sub_spec in zip(names, specs, strict=True):
                count = _count(sub_spec)
                values[name] = unflatten(leaves[position : position + count], sub_spec)
                position += count
            outer.append(_with_fields(obj, values))
        else:
            outer.append(leaves[position])
            position += size
    return pytree.tree_unflatten(outer, spec.node)


def _count(spec: Spec) -> int:
    return sum(spec.sizes)


def _with_fields(obj: Any, values: dict[str, Any]) -> Any:
    """``obj`` itself when no field changed, else a shallow copy with the new field values (frozen ones too)."""
    if all(getattr(obj, name) is value for name, value in values.items()):
        return obj
    new = copy.copy(obj)
    for name, value in values.items():
        object.__setattr__(new, name, value)
    return new


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt as they were.

    Example:
        >>> map_tensors(lambda t: t * 2, {"x": torch.ones(2), "n": 3})
        {'x': tensor([2., 2.]), 'n': 3}
    """
    leaves, spec = flatten(value)
    return unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value``, in order (the order of :func:`flatten`).

    Example:
        >>> [t.shape for t in tensors((torch.ones(2), [3, {"k": torch.ones(1, 4)}]))]
        [torch.Size([2]), torch.Size([1, 4])]
    """
    return [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]
