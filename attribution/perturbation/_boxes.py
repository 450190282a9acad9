"""Which box of each node's output a group of occlusion windows changes (pure planning on a traced graph).

A group of windows runs together when, at every node, their boxes have one size: the crops then stack along the
batch axis. Each window's box is the region its change reaches (:mod:`._regions`), widened inside the tensor to
the largest box of the group (computing more positions than changed is exact: they are computed from their
inputs as the full forward computes them). A node's step is ``None`` (no window changes it: its clean output is
used), :data:`FULL` (an op that is not local, an input that is already full, or boxes that cover the whole output:
run whole on the group, one row per window), or one box per window, all of one size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import fx

from ._regions import Span, reached, union, widened

Box = tuple[Span, Span]
Dims = tuple[tuple[int, int, int, int], ...]
"""Per spatial dim ``(kernel, stride, padding, dilation)`` of a conv or pool."""
Kind = tuple[str, Dims | None]
"""How a node runs on a box: ``("slide", dims)``, ``("point", None)``, ``("add", None)`` or ``("whole", None)``."""
FULL = "full"
Step = tuple[Box, ...] | str | None


def _empty(box: Box) -> bool:
    return any(a >= b for a, b in box)


def equal_sizes(boxes: Sequence[Box], size: tuple[int, int]) -> tuple[Box, ...] | None:
    """The boxes widened to the largest's size per dim (empty ones placed at their start); ``None`` if all empty."""
    full = [box for box in boxes if not _empty(box)]
    if not full:
        return None
    lengths = [max(b - a for a, b in (box[d] for box in full)) for d in range(2)]
    return tuple((widened(box[0], lengths[0], size[0]), widened(box[1], lengths[1], size[1])) for box in boxes)


def _step(kind: Kind, changed: list[tuple[Box, ...]], size: tuple[int, int]) -> Step:
    name, dims = kind
    if name == "point":
        return changed[0]
    if name == "slide":
        assert dims is not None
        (k, s, p, d), (k2, s2, p2, d2) = dims
        boxes = [(reached(r, k, s, p, d, size[0]), reached(c, k2, s2, p2, d2, size[1])) for r, c in changed[0]]
        return equal_sizes(boxes, size)
    unions: list[Box] = []
    for inputs in zip(*changed, strict=True):  # "add": per window, the union of its changed inputs' boxes
        first, *rest = inputs
        for other in rest:
            first = (union(first[0], other[0]), union(first[1], other[1]))
        unions.append(first)
    return equal_sizes(unions, size)


def group_plan(
    nodes: Iterable[fx.Node],
    kinds: Mapping[fx.Node, Kind],
    sizes: Mapping[fx.Node, tuple[int, int]],
    windows: Sequence[Box],
) -> dict[fx.Node, Step]:
    """Each node's step for a group of windows (each the input box it changes), in the graph's order.

    Args:
        nodes: the traced graph's nodes (placeholder first, output last).
        kinds: how each node other than the placeholder and the output runs on a box.
        sizes: the spatial size ``(height, width)`` of each node's output that has one (local nodes and the input).
        windows: per window, the box of the input it changes.
    """
    plan: dict[fx.Node, Step] = {}
    for node in nodes:
        if node.op == "output":
            break
        changed = [plan[n] for n in node.all_input_nodes if plan[n] is not None]
        step: Step
        if node.op == "placeholder":
            step = equal_sizes(windows, sizes[node])
        elif not changed:
            step = None
        elif kinds[node][0] == "whole" or any(step == FULL for step in changed):
            step = FULL
        else:
            step = _step(kinds[node], changed, sizes[node])  # type: ignore[arg-type]
        whole = ((0, sizes[node][0]), (0, sizes[node][1])) if node in sizes else None
        plan[node] = FULL if isinstance(step, tuple) and all(box == whole for box in step) else step
    return plan
