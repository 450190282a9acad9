"""Backward hooks that line up with the forward: the gradients of one forward call, gathered by tensor hooks.

A :class:`BackwardCall` is made when a module with active backward hooks starts a call under autograd. It gives the
module aliases of its inputs and hooks on its outputs, collects the gradients that arrive through them during a
backward pass, and calls the hooks once per pass with ``grad_input`` and ``grad_output`` in the order of the call's
input and output tensors.

What the caller and the module see is the computation they would see without hooks:

* Inputs that require grad are replaced by a view of themselves (``x.view_as(x)``), one view per distinct tensor, so a
  tensor passed as several arguments is still one object (``nn.MultiheadAttention`` checks ``query is key``). For a
  module that writes into its input (``inplace=True``), the alias is a copy whose new value is written back into
  the caller's tensor after the call, and the module returns the caller's tensor as it would have.
* Outputs are hooked as they are, except a parameter returned as is (hooked through a view, so no hook stays on it)
  and outputs with storage of their own that must be separated from each other or that are views (passed on as
  copies: the same values, and their gradient then comes only from what the caller does with them). An output
  sharing storage with an input (an identity, ``Flatten``, a dropout in eval mode) is never copied: the caller may
  write into it and expect the write to reach the input.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _tree

if TYPE_CHECKING:
    from ._handle import HookHandle


def graph_task() -> int:
    """The id of the backward pass running in this thread, or -1 outside any."""
    return int(_current_graph_task_id())


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
        return -id(t)


class BackwardCall:
    """The gradients of one forward call of one module, handed to its backward hooks once per backward pass."""

    __slots__ = (
        "aliases", "arrived", "call", "expected", "extras", "fired", "fragile", "grad_in", "grad_out", "handles",
        "input_storages", "module", "name", "task", "thread",
    )  # fmt: skip

    def __init__(
        self, module: nn.Module, name: str, call: int, handles: list[HookHandle], thread: threading.Thread
    ) -> None:
        self.module = module
        self.name = name
        self.call = call
        self.handles = handles
        self.thread = thread  # the thread whose activation decides, also when gradients arrive in another thread
        self.grad_in: list[torch.Tensor | None] = []
        self.grad_out: list[torch.Tensor | None] = []
        self.expected: set[tuple[str, int]] = set()
        self.arrived: set[tuple[str, int]] = set()
        # (positions, weak ref to the alias, its version, the caller's tensor if the alias is a copy): weak, so that
        # a record left behind by a forward that raised does not keep the input's graph alive
        self.aliases: list[tuple[tuple[int, ...], weakref.ref[torch.Tensor], int, torch.Tensor | None]] = []
        self.input_storages: set[int] = set()
        self.fragile: list[tuple[torch.Tensor, int]] = []  # outputs that are views of an input, until the forward ends
        self.fired = False
        self.task = -2  # the backward pass whose gradients are being gathered
        wanted = {k for h in handles for k in h.asks}
        self.extras: dict[str, Any] = {"name": name, "call": call, "args": None, "kwargs": None, "output": None}
        if not wanted & {"args", "kwargs", "output"}:
            self.extras = {"name": name, "call": call}

    # -- forward side ----------------------------------------------------------------------------------------------
    def take_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, copy: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Alias the inputs that require grad and hook the aliases; return the (possibly new) args and kwargs."""
        leaves, spec = _tree.flatten((args, kwargs))
        self.grad_in = [None] * len(leaves)
        if "args" in self.extras:
            self.extras["args"], self.extras["kwargs"] = args, kwargs
        positions: dict[int, list[int]] = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.input_storages.add(_storage(leaf))
                if leaf.requires_grad:
                    positions.setdefault(id(leaf), []).append(i)
        if not positions:
            return args, kwargs
        for where in positions.values():
            leaf = leaves[where[0]]
            alias = leaf.clone() if copy else leaf.view_as(leaf)
            alias.register_hook(_Collect(self, "in", tuple(where)))
            self.aliases.append((tuple(where), weakref.ref(alias), alias._version, leaf if copy else None))
            self.expected.add(("in", where[0]))
            for i in where:
                leaves[i] = alias
        new_args, new_kwargs = _tree.unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)

    def take_outputs(self, output: Any) -> tuple[Any, bool]:
        """Hook the output tensors; return the output to pass on and whether the module wrote into an input view."""
        written_back: dict[int, torch.Tensor] = {}
        overwritten: list[int] = []
        for where, ref, version, original in self.aliases:
            alias = ref()
            if alias is None or alias._version == version:
                continue
            if original is None:  # a view: the write reached the caller's tensor, but the view's hook is lost
                overwritten.extend(where)
                self.expected.discard(("in", where[0]))
            else:  # a copy: give the caller's tensor the value the module wrote, as without hooks
                original.copy_(alias)
                written_back[id(alias)] = original
        aliases = {id(ref()) for _, ref, _, _ in self.aliases}
        self.aliases = []
        leaves, spec = _tree.flatten(output)
        self.grad_out = [None] * len(leaves)
        if "output" in self.extras:
            self.extras["output"] = output
        positions: dict[int, list[int]] = {}
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                positions.setdefault(id(leaf), []).append(j)
        replaced = False
        returned_aliases = set()
        for positions_of_leaf in positions.values():
            where = tuple(positions_of_leaf)
            leaf = leaves[where[0]]
            if id(leaf) in aliases:
                returned_aliases.add(where[0])
            if id(leaf) in written_back:  # an in-place module returns the caller's tensor itself
                leaf = written_back[id(leaf)]
            elif _storage(leaf) in self.input_storages:  # shares memory with an input: never a copy
                if len(positions) > 1:  # a view of itself separates it from the other outputs, memory still shared
                    leaf = leaf.view_as(leaf)
                if leaf._is_view():
                    self.fragile.append((leaf, leaf._version))
            elif leaf.is_leaf:  # a parameter returned as is: no hook may stay on it
                leaf = leaf.view_as(leaf)
            elif len(positions) > 1 or leaf._is_view():
                leaf = leaf.clone()
            if leaf is not leaves[where[0]]:
                replaced = True
                for j in where:
                    leaves[j] = leaf
            leaf.register_hook(_Collect(self, "out", tuple(where)))
        if overwritten:
            warnings.warn(
                f"module {self.name!r} modified its input in place; grad_input for this call is None at "
                f"position(s) {overwritten}. Later calls copy the input first, so their gradients are complete.",
                RuntimeWarning,
                stacklevel=2,
            )
        if not any(key[0] == "in" for key in self.expected):
            self.expected.update(("out", where[0]) for where in positions.values())
        else:  # an input returned as it is: its gradient as an output arrives through the same tensor
            self.expected.update(("out", j) for j in returned_aliases)
        return (_tree.unflatten(leaves, spec) if replaced else output), bool(overwritten)

    def lost_outputs(self) -> bool:
        """Whether an output that is a view of an input was written in place through a view (dropping its hooks).

        A write through a view leaves the base with a ``CopySlices`` node; a write into the base itself after the
        view's last use does not drop the view's hooks. Asked when the forward of the model ends; the references to
        the outputs are dropped then.
        """
        fragile, self.fragile = self.fragile, []
        return any(
            t._version != version and type(getattr(t._base, "grad_fn", None)).__name__ == "CopySlices"
            for t, version in fragile
        )

    # -- backward side -------------------------------------------------------------------------------------------
    def collect(self, side: str, where: tuple[int, ...], grad: torch.Tensor) -> None:
        """Store one gradient; fire when the expected ones are in, else at the end of this backward pass."""
        task = graph_task()
        if task != self.task:  # a new backward pass (also after one that was aborted by an exception)
            self._reset(task)
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_pass)
        store = self.grad_in if side == "in" else self.grad_out
        for i in where:
            store[i] = grad
        self.arrived.add((side, where[0]))
        if not self.fired and self.expected <= self.arrived:
            self.fire()

    def fire(self) -> None:
        """Call every backward hook that was active for the call and still is (and is not removed)."""
        self.fired = True
        grad_in, grad_out = tuple(self.grad_in), tuple(self.grad_out)
        for h in self.handles:
            if not h.removed and h.fires(self.thread):
                h.invoke(self.module, grad_in, grad_out, self.extras)

    def end_of_pass(self) -> None:
        """Fire if still pending (with ``None`` for gradients that never came), then forget this pass."""
        try:
            if not self.fired:
                self.fire()
        finally:
            self._reset(-2)

    def _reset(self, task: int) -> None:
        self.task = task
        self.fired = False
        self.arrived = set()
        self.grad_in = [None] * len(self.grad_in)
        self.grad_out = [None] * len(self.grad_out)


class _Collect:
    """Tensor hook that passes one gradient to its record (and never changes it)."""

    __slots__ = ("record", "side", "where")

    def __init__(self, record: BackwardCall, side: str, where: tuple[int, ...]) -> None:
        self.record, self.side, self.where = record, side, where

    def __call__(self, grad: torch.Tensor) -> None:
        self.record.collect(self.side, self.where, grad)
