"""What a dataset run computes, as text that changes when the computation does: model digests, callables, items.

A resumed run must continue the same computation, so its settings describe the model by a digest of its parameters
and buffers, and callables (the method, a callable target) by their code and the values they hold: closure cells,
defaults, the arguments of a ``functools.partial``, the object behind a bound method, the attributes of a callable
object, the global values a function reads. A value that cannot be read (an object with neither a stable ``repr``
nor attributes) is described as ``<unreadable ...>``: a run holding one can be resumed only under an explicit
``run_name``. Each stored item carries a digest of its collated inputs and label, checked when a resume skips it.
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

import numpy as np
import torch
from torch import nn

from hooks import flatten

UNREADABLE = "<unreadable"
_DEPTH = 4  # how deep callables and containers are followed
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)


def _hash(*chunks: bytes | memoryview) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()[:16]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` on the CPU (any dtype, bfloat16 included)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data)


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and values."""
    return _hash(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), _tensor_bytes(tensor))


def model_digest(model: nn.Module) -> str:
    """A digest of every parameter and buffer of ``model`` (names, dtypes, shapes, values).

    Example:
        >>> import torch
        >>> a = torch.nn.Linear(2, 2)
        >>> model_digest(a) == model_digest(a), len(model_digest(a))
        (True, 16)
    """
    h = hashlib.sha256()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
            h.update(_tensor_bytes(tensor))
    return h.hexdigest()[:16]


def _code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does (bytecode, constants, names), not where it is in its file."""
    consts = [_code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return _hash(code.co_code, repr((consts, code.co_names, code.co_varnames)).encode())


def describe(obj: Any, depth: int = _DEPTH) -> str:
    """Text that is the same in every process for the same computation, and differs when code or values do.

    Example:
        >>> describe(lambda x: x + 1) != describe(lambda x: x + 2)
        True
    """
    if isinstance(obj, _SIMPLE):
        return repr(obj)
    if depth < 0:
        return f"{UNREADABLE} {type(obj).__name__} (nested too deeply)>"
    if isinstance(obj, torch.Tensor):
        return f"tensor {tensor_digest(obj)}"
    if isinstance(obj, np.ndarray):
        return f"array {tensor_digest(torch.from_numpy(np.ascontiguousarray(obj)))}"
    if isinstance(obj, nn.Module):
        return f"{type(obj).__name__} (weights {model_digest(obj)})"
    if isinstance(obj, (tuple, list, set, frozenset)):
        parts = sorted(describe(v, depth - 1) for v in obj) if isinstance(obj, (set, frozenset)) else None
        return f"{type(obj).__name__}({parts or [describe(v, depth - 1) for v in obj]})"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{describe(k, depth - 1)}: {describe(v, depth - 1)}" for k, v in obj.items()) + "}"
    if isinstance(obj, functools.partial):
        return f"partial({describe(obj.func, depth - 1)}, {describe(obj.args, depth - 1)}, " + (
            f"{describe(obj.keywords, depth - 1)})"
        )
    if isinstance(obj, types.FunctionType):
        return _function(obj, depth)
    if isinstance(obj, types.MethodType):
        return f"{describe(obj.__self__, depth - 1)}.{_function(obj.__func__, depth)}"  # type: ignore[arg-type]
    if isinstance(obj, (types.BuiltinFunctionType, types.ModuleType, type)):
        return f"{getattr(obj, '__module__', None) or ''}.{getattr(obj, '__qualname__', obj.__name__)}"
    return _instance(obj, depth)


def _function(fn: types.FunctionType, depth: int) -> str:
    """A Python function: name, code, defaults, closure values and the global values its code reads."""
    bound: dict[str, Any] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            bound[name] = cell.cell_contents
        except ValueError:  # an empty cell
            bound[name] = None
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if name in fn.__globals__ and not isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType)):
            text = describe(value, depth - 1)
            if UNREADABLE not in text:  # a global the code may only pass along (a dataset) is left out
                bound[name] = text
    parts = [f"{fn.__module__}.{fn.__qualname__} code {_code_digest(fn.__code__)}"]
    if fn.__defaults__ or fn.__kwdefaults__:
        parts.append(f"defaults {describe((fn.__defaults__, fn.__kwdefaults__), depth - 1)}")
    if bound:
        parts.append(f"values {describe(dict(sorted(bound.items())), depth - 1)}")
    return " ".join(parts)


def _instance(obj: Any, depth: int) -> str:
    """Another object: its ``repr`` when that is stable, else its class, its ``__call__`` and its attributes."""
    text = repr(obj)
    if " at 0x" not in text:
        return text
    cls = type(obj)
    call = getattr(cls, "__call__", None)  # noqa: B004
    code = f" code {_code_digest(call.__code__)}" if isinstance(call, types.FunctionType) else ""
    attributes = getattr(obj, "__dict__", None)
    if not attributes:
        return f"{UNREADABLE} {cls.__module__}.{cls.__qualname__}>"
    return f"{cls.__module__}.{cls.__qualname__}{code} {describe(attributes, depth - 1)}"


def item_digests(batch: Any, items: int) -> list[str]:
    """One digest per item of a collated batch: every tensor's row of that item, every other leaf as text."""
    leaves = flatten(batch)[0]
    hashes = [hashlib.sha256() for _ in range(items)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == items:
            rows = leaf.detach().to("cpu").contiguous()
            for h, row in zip(hashes, rows, strict=True):
                h.update(f"{row.dtype}{tuple(row.shape)}".encode())
                h.update(_tensor_bytes(row))
        else:
            text = describe(leaf).encode()
            for h in hashes:
                h.update(text)
    return [h.hexdigest()[:16] for h in hashes]
