"""Incremental inference for image occlusion: recompute per layer only the region a changed input box reaches.

The model is traced once with ``torch.fx``; the clean image runs once with every node's output kept. For one
perturbed image whose change lies in a spatial box, each node is then either unchanged (the clean output is used),
a box (only that crop of its output is computed, from its inputs' crops with their halo), or full (computed
normally). Known local ops: ``Conv2d`` (zero padding), ``MaxPool2d`` (no ceil mode), ``BatchNorm2d`` in eval mode,
``ReLU``/``ReLU6``/``GELU``/``SiLU``/``Identity``, and additions. Every other op, given a changed input, runs in
full on inputs pasted into the clean tensors, so the result equals the full forward's up to rounding.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from hooks import hooked_modules

from ._regions import Span, reached, read, union

Box = tuple[Span, Span]
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Identity)


def plan(model: nn.Module, inputs: torch.Tensor) -> fx.GraphModule | str:
    """The traced model if incremental occlusion applies to it and ``inputs``, else the reason it does not."""
    if inputs.dim() != 4 or not inputs.is_floating_point():
        return f"incremental occlusion needs floating-point images (batch, C, H, W); got {tuple(inputs.shape)}"
    if hooked_modules(model):
        return "the model has hooks, which the incremental run would call on crops (or not at all)"
    graph = trace(model)
    if isinstance(graph, str):
        return graph
    if not any(_window(m) is not None for m in graph.modules()):
        return "the model has no Conv2d or MaxPool2d module: no layer computes less on a window's region"
    return graph


def trace(model: nn.Module) -> fx.GraphModule | str:
    """The traced model, or the reason it cannot be traced (the caller then runs full forwards)."""
    try:
        return fx.symbolic_trace(model)
    except Exception as error:
        return f"torch.fx cannot trace {type(model).__name__}: {type(error).__name__}: {error}"


def _overlap(first: Span, second: Span) -> Span:
    """The part of ``first`` inside ``second`` (empty when ``stop <= start``)."""
    return max(first[0], second[0]), min(first[1], second[1])


def _crop(value: Any, clean: torch.Tensor, box: Box) -> torch.Tensor:
    """The region ``box`` of a node's output: the clean crop with the node's changed crop pasted where they overlap.

    The changed crop may reach outside ``box`` (a 1x1 stride-2 conv reads every other row of its changed input), so
    only the overlap is pasted.
    """
    (a, b), (c, d) = box
    out = clean[..., a:b, c:d]
    if value is None:
        return out
    (va, vb), (vc, vd) = value[0]
    (lo, hi), (left, right) = _overlap((va, vb), (a, b)), _overlap((vc, vd), (c, d))
    if lo >= hi or left >= right:
        return out
    out = out.clone()
    out[..., lo - a : hi - a, left - c : right - c] = value[1][..., lo - va : hi - va, left - vc : right - vc]
    return out


def _window(module: nn.Module) -> tuple[tuple[int, int, int, int], ...] | None:
    """Per spatial dim ``(kernel, stride, padding, dilation)`` of a conv/pool this runs on crops, else ``None``."""
    if isinstance(module, nn.Conv2d) and module.padding_mode == "zeros" and not isinstance(module.padding, str):
        parts: tuple[Any, ...] = (module.kernel_size, module.stride, module.padding, module.dilation)
    elif isinstance(module, nn.MaxPool2d) and not module.ceil_mode:
        raw = (module.kernel_size, module.stride or module.kernel_size, module.padding, module.dilation)
        parts = tuple(p if isinstance(p, tuple) else (p, p) for p in raw)
    else:
        return None
    return tuple((int(k), int(s), int(p), int(d)) for k, s, p, d in zip(*parts, strict=True))


def _sliding(
    module: nn.Module,
    dims: tuple[tuple[int, int, int, int], ...],
    value: Any,
    clean_in: torch.Tensor,
    clean_out: torch.Tensor,
) -> Any:
    """A conv or max pool on the crop its changed outputs read, padded as the module pads."""
    box = tuple(
        reached(s, d[0], d[1], d[2], d[3], n) for s, d, n in zip(value[0], dims, clean_out.shape[-2:], strict=True)
    )
    if any(a >= b for a, b in box):
        return None  # a strided window skips every changed input: the output is the clean one
    spans = [read(s, *d) for s, d in zip(box, dims, strict=True)]
    sizes = clean_in.shape[-2:]
    inside = tuple((max(a, 0), min(b, n)) for (a, b), n in zip(spans, sizes, strict=True))
    crop = _crop(value, clean_in, inside)  # type: ignore[arg-type]
    pads = (
        inside[1][0] - spans[1][0],
        spans[1][1] - inside[1][1],
        inside[0][0] - spans[0][0],
        spans[0][1] - inside[0][1],
    )
    if isinstance(module, nn.Conv2d):
        crop = F.pad(crop, pads)
        out = F.conv2d(crop, module.weight, module.bias, module.stride, 0, module.dilation, module.groups)
    else:
        crop = F.pad(crop, pads, value=-torch.inf)
        out = F.max_pool2d(crop, [k for k, *_ in dims], [d[1] for d in dims], 0, [d[3] for d in dims])
    return box, out


class IncrementalRunner:
    """Runs perturbed copies of one image, recomputing only what each change reaches.

    Args:
        graph: the traced model (:func:`trace`), in eval mode.
        clean: the unperturbed input ``(1, channels, height, width)``.
    """

    def __init__(self, graph: fx.GraphModule, clean: torch.Tensor) -> None:
        self.graph = graph
        self.modules = dict(graph.named_modules())
        self.clean: dict[fx.Node, Any] = {}
        interpreter = fx.Interpreter(graph)
        env = interpreter.env

        for node in graph.graph.nodes:
            self.clean[node] = interpreter.run_node(node) if node.op != "placeholder" else clean
            env[node] = self.clean[node]

    def run(self, perturbed: torch.Tensor, box: Box) -> Any:
        """The model's output on ``perturbed`` ``(1, C, H, W)``, which equals the clean input outside ``box``."""
        values: dict[fx.Node, Any] = {}
        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                values[node] = (box, perturbed[..., box[0][0] : box[0][1], box[1][0] : box[1][1]])
            elif node.op == "output":
                return self._value(node.args[0], values)
            else:
                values[node] = self._node(node, values)
        raise RuntimeError("the traced graph has no output node")

    def _node(self, node: fx.Node, values: dict[fx.Node, Any]) -> Any:
        """One node's value: ``None`` (unchanged), ``(box, crop)``, or ``("full", tensor)``."""
        inputs = [n for n in node.all_input_nodes]
        changed = [n for n in inputs if values[n] is not None]
        if not changed:
            return None
        boxed = all(values[n][0] != "full" for n in changed)
        module = self.modules.get(str(node.target)) if node.op == "call_module" else None
        if boxed and module is not None and len(inputs) == 1:
            dims = _window(module)
            if dims is not None:
                return _sliding(module, dims, values[inputs[0]], self.clean[inputs[0]], self.clean[node])
            if isinstance(module, _POINTWISE) or (isinstance(module, nn.BatchNorm2d) and not module.training):
                return values[inputs[0]][0], module(values[inputs[0]][1])
        if boxed and node.op == "call_function" and node.target in (operator.add, torch.add) and not node.kwargs:
            if len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
                return self._add(node.args[0], node.args[1], changed, values)  # type: ignore[arg-type]
        return self._whole(node, values)

    def _add(self, first: fx.Node, second: fx.Node, changed: list[fx.Node], values: dict[fx.Node, Any]) -> Any:
        """A residual addition on the union of its inputs' boxes."""
        box: Box = values[changed[0]][0]
        for n in changed[1:]:
            box = (union(box[0], values[n][0][0]), union(box[1], values[n][0][1]))
        return box, _crop(values[first], self.clean[first], box) + _crop(values[second], self.clean[second], box)

    def _whole(self, node: fx.Node, values: dict[fx.Node, Any]) -> Any:
        """An unknown op, or a changed input that fills its tensor: run the node on whole inputs."""
        env = {n: self._value(n, values) for n in node.all_input_nodes}
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "call_module":
            out = self.modules[str(node.target)](*args, **kwargs)
        elif node.op == "call_function":
            out = node.target(*args, **kwargs)  # type: ignore[operator]
        elif node.op == "call_method":
            out = getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]
        else:
            out = getattr(self.graph, node.target)  # type: ignore[arg-type]
        return ("full", out)

    def _value(self, node: fx.Node, values: dict[fx.Node, Any]) -> Any:
        value = values[node]
        if value is None:
            return self.clean[node]
        if value[0] == "full":
            return value[1]
        clean = self.clean[node]
        return _crop(value, clean, ((0, clean.shape[-2]), (0, clean.shape[-1])))
