"""List every module call of one forward, in the order the calls start."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _tree
from .manager import HookManager


@dataclass(frozen=True)
class ModuleCall:
    """One call of one module during a traced forward.

    Attributes:
        index: position of the call in start order (0 for the first module called).
        name: qualified module name.
        type: the module's class name.
        call: how many calls of the same module came before this one in the forward (0 for the first).
        depth: nesting depth (0 for direct children of the model).
        input_shapes: shapes of the tensors in the arguments (positional, then keyword), in order.
        output_shapes: shapes of the tensors in the output, in order.
    """

    index: int
    name: str
    type: str
    call: int
    depth: int
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]


class Trace(list[ModuleCall]):
    """The calls of a traced forward; ``str()`` gives an indented table."""

    @property
    def names(self) -> list[str]:
        """Module names in call order; a module called twice appears twice."""
        return [c.name for c in self]

    def __str__(self) -> str:
        def shapes(s: tuple[tuple[int, ...], ...]) -> str:
            return ", ".join("x".join(map(str, shape)) or "scalar" for shape in s) or "-"

        rows = [("#", "module", "type", "input", "output")]
        for c in self:
            label = "  " * c.depth + c.name + (f" (call {c.call})" if c.call else "")
            rows.append((str(c.index), label, c.type, shapes(c.input_shapes), shapes(c.output_shapes)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x.shape) for x in _tree.tensors(value))


def trace(model: nn.Module, *inputs: Any, grad: bool = False, **kwargs: Any) -> Trace:
    """Run ``model(*inputs, **kwargs)`` once and list every submodule call in the order the calls start.

    Repeated calls of a module (a ReLU used twice, a shared block) appear once per call. All hooks are removed
    afterwards, also when the forward raises.

    Args:
        model: the model.
        *inputs: positional inputs of the forward.
        grad: run with autograd enabled (default: under ``torch.no_grad()``).
        **kwargs: keyword inputs of the forward.

    Example:
        >>> import torch
        >>> from hooks import trace
        >>> relu = torch.nn.ReLU()
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), relu, torch.nn.Linear(4, 4), relu)
        >>> print(trace(model, torch.randn(2, 3)))
        #  module      type    input  output
        0  0           Linear  2x3    2x4
        1  1           ReLU    2x4    2x4
        2  2           Linear  2x4    2x4
        3  1 (call 1)  ReLU    2x4    2x4
    """
    calls: list[dict[str, Any]] = []
    stack = threading.local()

    def before(module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any], *, name: str, call: int) -> None:
        depth = getattr(stack, "depth", 0)
        stack.__dict__.setdefault("open", []).append(len(calls))
        stack.depth = depth + 1
        calls.append(
            {
                "index": len(calls),
                "name": name,
                "type": type(module).__name__,
                "call": call,
                "depth": depth,
                "input_shapes": _shapes((args, kw)),
                "output_shapes": (),
            }
        )

    def after(module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str, call: int) -> None:
        calls[stack.open.pop()]["output_shapes"] = _shapes(output)
        stack.depth -= 1

    submodules = [m for n, m in model.named_modules() if n]
    if not submodules:
        return Trace()
    with HookManager(model) as mgr, torch.set_grad_enabled(grad):
        group = mgr.group("trace")
        group.forward_pre(submodules, before, with_kwargs=True)
        group.forward(submodules, after)
        model(*inputs, **kwargs)
    return Trace(ModuleCall(**c) for c in calls)
