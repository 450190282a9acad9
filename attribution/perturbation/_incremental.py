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
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from hooks import hooked_modules

from ._boxes import FULL, Box, Dims, Kind, Step, equal_sizes, group_plan
from ._regions import Span, read

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


def _window(module: nn.Module) -> Dims | None:
    """Per spatial dim ``(kernel, stride, padding, dilation)`` of a conv/pool this runs on crops, else ``None``."""
    if isinstance(module, nn.Conv2d) and module.padding_mode == "zeros" and not isinstance(module.padding, str):
        parts: tuple[Any, ...] = (module.kernel_size, module.stride, module.padding, module.dilation)
    elif isinstance(module, nn.MaxPool2d) and not module.ceil_mode:
        raw = (module.kernel_size, module.stride or module.kernel_size, module.padding, module.dilation)
        parts = tuple(p if isinstance(p, tuple) else (p, p) for p in raw)
    else:
        return None
    return tuple((int(k), int(s), int(p), int(d)) for k, s, p, d in zip(*parts, strict=True))


def _inside(span: Span, size: int) -> Span:
    return max(span[0], 0), min(span[1], size)


def gather(clean: torch.Tensor, changed: torch.Tensor | None, boxes: Step, spans: Sequence[Box], fill: float) -> Any:
    """Per window the region ``spans[i]`` of a node's output, stacked ``(windows, C, h, w)``.

    The region is the clean output (``clean``, batch 1) with window ``i``'s changed crop ``changed[i]`` (at
    ``boxes[i]``) pasted where they overlap, and ``fill`` where the span lies outside the tensor (padding). The
    spans have one size. A changed crop may reach outside its span (a 1x1 stride-2 conv reads every other changed
    row), so only the overlap is pasted.
    """
    if changed is not None and tuple(spans) == boxes:
        return changed
    size = clean.shape[-2:]
    pieces = []
    for span in spans:
        (a, b), (c, d) = _inside(span[0], size[0]), _inside(span[1], size[1])
        piece = clean[0, :, a:b, c:d]
        pads = (c - span[1][0], span[1][1] - d, a - span[0][0], span[0][1] - b)
        pieces.append(F.pad(piece, pads, value=fill) if any(pads) else piece)
    out = torch.stack(pieces)
    if changed is None:
        return out
    assert isinstance(boxes, tuple)
    for i, (span, box) in enumerate(zip(spans, boxes, strict=True)):
        (lo, hi), (left, right) = (
            (max(box[0][0], span[0][0], 0), min(box[0][1], span[0][1])),
            (max(box[1][0], span[1][0], 0), min(box[1][1], span[1][1])),
        )
        if lo < hi and left < right:
            rows, cols = slice(lo - span[0][0], hi - span[0][0]), slice(left - span[1][0], right - span[1][0])
            out[i, :, rows, cols] = changed[i, :, lo - box[0][0] : hi - box[0][0], left - box[1][0] : right - box[1][0]]
    return out


class IncrementalRunner:
    """Runs groups of perturbed copies of one image, recomputing only what each change reaches, batched.

    Args:
        graph: the traced model (:func:`trace`), in eval mode.
        clean: the unperturbed input ``(1, channels, height, width)``.
    """

    def __init__(self, graph: fx.GraphModule, clean: torch.Tensor) -> None:
        self.graph = graph
        self.nodes = list(graph.graph.nodes)
        self.modules = dict(graph.named_modules())
        self.clean: dict[fx.Node, Any] = {}
        interpreter = fx.Interpreter(graph)
        for node in self.nodes:
            self.clean[node] = interpreter.run_node(node) if node.op != "placeholder" else clean
            interpreter.env[node] = self.clean[node]
        self.sizes = {n: tuple(v.shape[-2:]) for n, v in self.clean.items() if _image(v)}
        self.kinds = {n: self._kind(n) for n in self.nodes if n.op not in ("placeholder", "output")}

    def _kind(self, node: fx.Node) -> Kind:
        """How ``node`` runs on a box: only ops whose output is an image like their image inputs, else whole."""
        inputs = node.all_input_nodes
        if not _image(self.clean[node]) or not all(_image(self.clean[n]) for n in inputs):
            return ("whole", None)
        if node.op == "call_module" and len(inputs) == 1 and len(node.args) == 1 and not node.kwargs:
            module = self.modules[str(node.target)]
            dims = _window(module)
            if dims is not None:
                return ("slide", dims)
            if isinstance(module, _POINTWISE) or (isinstance(module, nn.BatchNorm2d) and not module.training):
                return ("point", None)
        shape = self.clean[node].shape
        if node.op == "call_function" and node.target in (operator.add, torch.add) and not node.kwargs:
            if len(node.args) == 2 and all(isinstance(a, fx.Node) and self.clean[a].shape == shape for a in node.args):
                return ("add", None)
        return ("whole", None)

    def run(self, crops: torch.Tensor, windows: Sequence[Box]) -> Any:
        """The model's output on a group of perturbed images, one row per window.

        Args:
            crops: ``(windows, C, h, w)``: window ``i``'s image in ``windows[i]`` (it equals the clean image
                outside), all boxes of one size.
            windows: the boxes.
        """
        if equal_sizes(windows, self.sizes[self.nodes[0]]) != tuple(windows):
            raise ValueError(f"the windows' boxes must have one size inside the image; got {windows}")
        plan = group_plan(self.nodes, self.kinds, self.sizes, windows)
        values: dict[fx.Node, Any] = {}
        for node in self.nodes:
            step = plan.get(node)
            if node.op == "placeholder":
                values[node] = crops
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: self._whole(n, plan, values, len(windows)))
            elif step == FULL:
                values[node] = self._full(node, plan, values, len(windows))
            elif step is not None:
                values[node] = self._box(node, step, plan, values)  # type: ignore[arg-type]
        raise RuntimeError("the traced graph has no output node")

    def _box(self, node: fx.Node, boxes: tuple[Box, ...], plan: dict[fx.Node, Step], values: dict[fx.Node, Any]) -> Any:
        """A local op on its boxes: one call on the group's stacked crops."""
        name, dims = self.kinds[node]
        if name == "add":
            first, second = (n for n in node.args if isinstance(n, fx.Node))
            return gather(self.clean[first], values.get(first), plan[first], boxes, 0.0) + gather(
                self.clean[second], values.get(second), plan[second], boxes, 0.0
            )
        (source,) = node.all_input_nodes
        module = self.modules[str(node.target)]
        if name == "point":
            return module(values[source])
        assert dims is not None
        spans = [tuple(read(s, *d) for s, d in zip(box, dims, strict=True)) for box in boxes]
        if isinstance(module, nn.Conv2d):
            crop = gather(self.clean[source], values.get(source), plan[source], spans, 0.0)  # type: ignore[arg-type]
            return F.conv2d(crop, module.weight, module.bias, module.stride, 0, module.dilation, module.groups)
        crop = gather(self.clean[source], values.get(source), plan[source], spans, -torch.inf)  # type: ignore[arg-type]
        return F.max_pool2d(crop, [d[0] for d in dims], [d[1] for d in dims], 0, [d[3] for d in dims])

    def _full(self, node: fx.Node, plan: dict[fx.Node, Step], values: dict[fx.Node, Any], count: int) -> Any:
        """A non-local op, or a changed input that is already whole: run on whole inputs, one row per window."""
        args = fx.node.map_arg(node.args, lambda n: self._whole(n, plan, values, count))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self._whole(n, plan, values, count))
        if node.op == "call_module":
            return self.modules[str(node.target)](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]
        return getattr(self.graph, node.target)  # type: ignore[arg-type]

    def _whole(self, node: fx.Node, plan: dict[fx.Node, Step], values: dict[fx.Node, Any], count: int) -> Any:
        """A node's whole value for the group: the clean one repeated, or with each window's crop pasted in."""
        step, clean = plan.get(node), self.clean[node]
        if step == FULL:
            return values[node]
        if step is None:
            batched = isinstance(clean, torch.Tensor) and clean.dim() > 0 and clean.shape[0] == 1
            return clean.expand(count, *clean.shape[1:]) if batched else clean
        whole = clean.repeat(count, *([1] * (clean.dim() - 1)))
        for i, ((a, b), (c, d)) in enumerate(step):
            whole[i, :, a:b, c:d] = values[node][i]
        return whole


def _image(value: Any) -> bool:
    """Whether a clean value is one image's activation ``(1, C, H, W)``."""
    return isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[0] == 1
