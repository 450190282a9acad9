"""Backward hooks that line up with the forward: the gradients of one forward call, gathered by tensor hooks.

A :class:`BackwardCall` is made when a module with active backward hooks starts a call under autograd. It hooks the
call's outputs and the autograd nodes of the call that consume its inputs, collects the gradients that arrive
through them during a backward pass, and calls the hooks once per pass with ``grad_input`` and ``grad_output`` in
the order of the call's input and output tensors.

What the caller and the module see is the computation they would see without hooks, and autograd sums every gradient
in the same order (parameter gradients are bitwise those of an unobserved run):

* Inputs are passed on as they are. After the forward, the nodes made by the call (autograd sequence numbers at
  least the one at the start of the call) that send a gradient to an input are found from the outputs' nodes, and
  each gets a post-hook: the input's gradient through this call is the sum of what those nodes send it. A tensor
  passed at several positions (``attn(h, h, h)``) stays one object, so a module takes the path it would take (the
  packed projection of ``nn.MultiheadAttention``); its gradient is given once, at its first position, with zeros at
  the others, so that the positions add up to the gradient through the call.
* Outputs are hooked as they are, except an input returned unchanged (an identity, a dropout in eval mode: passed
  on as a view of itself, so that its gradient is told apart from the input's other uses), a parameter returned as
  is (hooked through a view, so no hook stays on it) and outputs with storage of their own that must be separated
  from each other or that are views (passed on as copies). Those are the only nodes observation adds; a view or copy
  passes its gradient on unchanged, so only the identity case can regroup a sum (when the input is also used by
  two or more others), by the last bit.
"""

from __future__ import annotations

import threading
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
        "arrivals", "arrived", "call", "edges", "expected", "extras", "fired", "fragile", "grad_in", "grad_out",
        "handles", "input_storages", "inputs", "module", "name", "pending", "start", "task", "thread",
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
        # between the two phases of the forward: each input that requires grad (its version, its positions) and the
        # autograd edge its gradient arrives through
        self.inputs: dict[int, tuple[torch.Tensor, int, list[int]]] = {}
        self.edges: dict[tuple[int, int], tuple[Any, tuple[int, ...]]] = {}
        self.start = 0  # the autograd sequence number when the call started: nodes made by the call have larger ones
        self.pending: dict[int, int] = {}  # input position -> how many of the call's nodes send it a gradient
        self.arrivals: dict[int, int] = {}  # input position -> how many of them did so in this pass
        self.input_storages: set[int] = set()
        self.fragile: list[tuple[torch.Tensor, int]] = []  # outputs that are views of an input, until the forward ends
        self.fired = False
        self.task = -2  # the backward pass whose gradients are being gathered
        wanted = {k for h in handles for k in h.asks}
        self.extras: dict[str, Any] = {"name": name, "call": call, "args": None, "kwargs": None, "output": None}
        if not wanted & {"args", "kwargs", "output"}:
            self.extras = {"name": name, "call": call}

    # -- forward side ----------------------------------------------------------------------------------------------
    def take_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note where the gradient of each input that requires grad will arrive; the inputs are passed on as they are.

        Nothing is put between the caller's tensors and the module: the gradient of an input through this call is
        read, after the forward, on the autograd nodes of the call that consume it (see :meth:`take_outputs`), so
        autograd sums a tensor's gradients in the order it would without hooks.
        """
        leaves, _ = _tree.flatten((args, kwargs))
        self.grad_in = [None] * len(leaves)
        if "args" in self.extras:
            self.extras["args"], self.extras["kwargs"] = args, kwargs
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.input_storages.add(_storage(leaf))
                if leaf.requires_grad:
                    self.inputs.setdefault(id(leaf), (leaf, leaf._version, []))[2].append(i)
        for leaf, _, where in self.inputs.values():
            node, nr = _gradient_edge(leaf)
            self.edges[id(node), nr] = (node, tuple(where))
        self.start = _sequence_nr()

    def take_outputs(self, output: Any) -> Any:
        """Hook the output tensors and the nodes that consume the inputs; return the output to pass on."""
        inputs, self.inputs = self.inputs, {}
        leaves, spec = _tree.flatten(output)
        self.grad_out = [None] * len(leaves)
        if "output" in self.extras:
            self.extras["output"] = output
        positions: dict[int, list[int]] = {}
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                positions.setdefault(id(leaf), []).append(j)
        replaced = False
        for positions_of_leaf in positions.values():
            where = tuple(positions_of_leaf)
            leaf = leaves[where[0]]
            unchanged_input = id(leaf) in inputs and inputs[id(leaf)][1] == leaf._version
            if unchanged_input or (len(positions) > 1 and _storage(leaf) in self.input_storages):
                leaf = leaf.view_as(leaf)  # an input returned as is: its own gradient, told apart from other uses
            elif _storage(leaf) in self.input_storages or id(leaf) in inputs:
                pass  # shares memory with an input (or is one, written in place): never a copy
            elif leaf.is_leaf:  # a parameter returned as is: no hook may stay on it
                leaf = leaf.view_as(leaf)
            elif len(positions) > 1 or leaf._is_view():
                leaf = leaf.clone()
            if leaf._is_view() and _storage(leaf) in self.input_storages:
                self.fragile.append((leaf, leaf._version))
            if leaf is not leaves[where[0]]:
                replaced = True
                for j in where:
                    leaves[j] = leaf
            leaf.register_hook(_Collect(self, "out", where))
        if self.edges:
            self._hook_consumers([leaves[p[0]] for p in positions.values()])
        if not self.pending:  # no input gradient to wait for: the call is complete when its outputs' gradients are
            self.expected.update(("out", p[0]) for p in positions.values())
        return _tree.unflatten(leaves, spec) if replaced else output

    def forget_inputs(self) -> None:
        """Let go of the inputs and their autograd nodes (a forward that raised before its outputs were taken)."""
        self.inputs, self.edges = {}, {}

    def _hook_consumers(self, outputs: list[torch.Tensor]) -> None:
        """Hook every node made by this call that sends a gradient to an input (found from the outputs' nodes)."""
        consumers: dict[int, tuple[Any, list[tuple[int, tuple[int, ...]]]]] = {}
        seen: set[int] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            for k, (child, nr) in enumerate(node.next_functions):
                if child is None:
                    continue
                edge = self.edges.get((id(child), nr))
                if edge is not None:
                    consumers.setdefault(id(node), (node, []))[1].append((k, edge[1]))
                elif id(child) not in seen and child._sequence_nr() >= self.start:
                    stack.append(child)
        self.edges = {}
        for node, slots in consumers.values():
            for _, where in slots:
                self.pending[where[0]] = self.pending.get(where[0], 0) + 1
            node.register_hook(_CollectInputs(self, tuple(slots)))
        self.expected.update(("in", first) for first in self.pending)

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
        """Store an output's gradient; fire when the expected ones are in, else at the end of this backward pass."""
        self._start_pass()
        for i in where:
            self.grad_out[i] = grad
        self._arrive(("out", where[0]))

    def collect_input(self, where: tuple[int, ...], grad: torch.Tensor | None) -> None:
        """Add one node's share of an input's gradient; the input is complete when each of its nodes has sent one."""
        self._start_pass()
        first = where[0]
        if grad is not None:
            held = self.grad_in[first]
            self.grad_in[first] = grad if held is None else held + grad
        self.arrivals[first] = self.arrivals.get(first, 0) + 1
        if self.arrivals[first] == self.pending.get(first, 0):
            total = self.grad_in[first]
            for i in where[1:]:  # the same tensor at other positions: its gradient is given once, at the first
                self.grad_in[i] = None if total is None else torch.zeros_like(total)
            self._arrive(("in", first))

    def _start_pass(self) -> None:
        task = graph_task()
        if task != self.task:  # a new backward pass (also after one that was aborted by an exception)
            self._reset(task)
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_pass)

    def _arrive(self, key: tuple[str, int]) -> None:
        self.arrived.add(key)
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
        self.arrivals = {}
        self.grad_in = [None] * len(self.grad_in)
        self.grad_out = [None] * len(self.grad_out)


def _gradient_edge(t: torch.Tensor) -> tuple[Any, int]:
    """The autograd node (and its output index) that receives the gradient of ``t``."""
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


_sequence_nr: Any = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)  # 0: walk the whole graph


class _CollectInputs:
    """Post-hook of one autograd node of a call: passes on its gradients for the call's inputs (never changes them)."""

    __slots__ = ("record", "slots")

    def __init__(self, record: BackwardCall, slots: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        self.record, self.slots = record, slots

    def __call__(self, grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> None:
        for k, where in self.slots:
            self.record.collect_input(where, grad_inputs[k])


class _Collect:
    """Tensor hook that passes one gradient to its record (and never changes it)."""

    __slots__ = ("record", "side", "where")

    def __init__(self, record: BackwardCall, side: str, where: tuple[int, ...]) -> None:
        self.record, self.side, self.where = record, side, where

    def __call__(self, grad: torch.Tensor) -> None:
        self.record.collect(self.side, self.where, grad)
