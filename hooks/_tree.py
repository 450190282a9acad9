"""Flatten and rebuild what modules take and return: tensors inside tuples, lists, dicts and dataclasses.

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


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to rebuild a flattened value: a pytree node, or a dataclass whose fields are children."""

    node: Any  # a pytree TreeSpec of the value, with dataclasses cut out as leaves
    dataclasses: tuple[tuple[int, Any, tuple[str, ...], tuple[Spec, ...]], ...]  # (leaf index, object, ...)
    sizes: tuple[int, ...]  # leaves each pytree leaf expands into


def _is_plain_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value) not in pytree.SUPPORTED_NODES


def flatten(value: Any) -> tuple[list[Any], Spec]:
    """The leaves of ``value`` (tensors and anything else that is not a container) and how to rebuild it."""
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
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    leaves, spec = flatten(value)
    return unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value``, in order."""
    return [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]
