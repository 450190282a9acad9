"""The kernel the three sweeps share: checks, the cells of a sweep and their place in an activation, metric checks.

A *cell* is one layer (module), and with ``positions`` one position (axis 1 of the activation, or the ``t`` axis of
``head_pattern``) and with ``heads`` one head (the ``h`` axis of ``head_pattern``). The cells of a sweep run in
row-major order of the result, ``(layers, [positions], [heads], [batch])``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from torch import nn

from hooks import ModuleTarget, resolve

from .._inputs import batch_size
from .._paired import check_same_shapes, checked_metric, plain
from .._run import Element, HookedRun, did_not_run, eager_module
from ..models import check_heads
from .result import PatchingResult, labelled
from .sites import Index, Recorded, Site, record

DEFAULT_HEAD_PATTERN = "b t (h d) -> b t h d"


@dataclass(frozen=True)
class Cell:
    layer: int
    position: int | None
    head: int | None


def ordered(model: nn.Module, layers: ModuleTarget) -> list[tuple[str, nn.Module]]:
    """Resolve layers keeping the user's order for explicit lists (globs expand in model order)."""
    if isinstance(layers, (list, tuple)):
        pairs = [pair for item in layers for pair in resolve(model, item, what="`layers`")]
        return list({id(m): (n, m) for n, m in reversed(pairs)}.values())[::-1]
    return resolve(model, layers, what="`layers`")


def view_axes(pattern: str | None, positions: bool) -> list[str]:
    """Axis names of the (viewed) activation: ``b t ...`` without a head pattern, else the pattern's right side."""
    if pattern is None:
        return ["b", "t"]
    right = pattern.split("->")[-1].split()
    needed = ["b", "h"] + (["t"] if positions else [])
    missing = [axis for axis in needed if axis not in right]
    if "->" not in pattern or missing or any("(" in a or ")" in a for a in right):
        raise ValueError(
            f"`head_pattern` {pattern!r} must view the activation with plain axes named b (batch), h (heads)"
            + (" and t (positions)" if positions else "")
            + f" on its right side; {', '.join(missing) or 'a grouped axis'} is not there"
        )
    return right


def cell_index(axes: list[str], rows: slice, cell: Cell) -> Index:
    """The index of one cell in the (viewed) activation, for the given batch rows."""
    index: list[Any] = [slice(None)] * len(axes)
    index[axes.index("b")] = rows
    if cell.position is not None:
        index[axes.index("t")] = cell.position
    if cell.head is not None:
        index[axes.index("h")] = cell.head
    used = [i for i, v in enumerate(index) if v != slice(None)]
    return tuple(index[: used[-1] + 1]) if used else ()


def plan_cells(
    names: list[str],
    acts: Recorded,
    positions: bool | Sequence[int],
    heads: int | None,
    head_pattern: str,
    axes: list[str],
) -> tuple[list[Cell], tuple[int, ...]]:
    first = acts[names[0]]
    if heads is not None:
        first = einops.rearrange(first, head_pattern, h=heads) if first.shape[-1] % heads == 0 else first
    t_axis = axes.index("t") if "t" in axes else 1
    if positions is not False and first.dim() <= t_axis:
        raise ValueError(
            f"positions index axis {t_axis}, but the activation of {names[0]!r} has shape {tuple(first.shape)}"
        )
    length = first.shape[t_axis] if first.dim() > t_axis else 0
    if positions is True:
        pos: list[int | None] = list(range(length))
    elif positions is False:
        pos = [None]
    else:
        given = [int(p) for p in positions]
        bad = [p for p in given if not -length <= p < length]
        pos = list(given)
        if bad:
            raise IndexError(f"position {bad[0]} is out of range for {length} positions")
    head_list: list[int | None] = [None]
    if heads is not None:
        for name in names:
            last = acts[name].shape[-1]
            if last % heads:
                raise ValueError(f"{heads} heads do not divide the last axis ({last}) of the activation of {name!r}")
            einops.rearrange(acts[name], head_pattern, h=heads)  # the pattern must fit
        head_list = list(range(heads))
    cells = [Cell(layer, p, h) for layer, p, h in itertools.product(range(len(names)), pos, head_list)]
    shape = (len(names),) + ((len(pos),) if positions is not False else ()) + ((heads,) if heads else ())
    return cells, shape


def cell_sums(
    product: torch.Tensor,
    positions: bool | Sequence[int],
    heads: int | None,
    head_pattern: str,
    per_example: bool,
) -> torch.Tensor:
    """Sum ``product`` (shaped like the activation) over each cell: ``([positions], [heads], [batch])``.

    Positions are axis 1 of the activation (or the ``t`` axis of ``head_pattern``), heads the ``h`` axis of the
    pattern, the batch axis 0 (or ``b``); every other axis is summed, and the batch too unless ``per_example``.

    Example:
        >>> cell_sums(torch.ones(2, 3, 4), True, 2, "b t (h d) -> b t h d", per_example=False)
        tensor([[4., 4.],
                [4., 4.],
                [4., 4.]])
    """
    if heads:
        view = einops.rearrange(product, head_pattern, h=heads)
        axes = head_pattern.split("->")[-1].split()
    else:
        view = product
        axes = ["b", "t", *(f"_{i}" for i in range(2, product.dim()))][: product.dim()]
    keep = (["t"] if positions is not False else []) + (["h"] if heads else []) + ["b"]
    order = [axes.index(a) for a in keep] + [i for i, a in enumerate(axes) if a not in keep]
    view = view.permute(order)
    sums = view.reshape(*view.shape[: len(keep)], -1).sum(-1)
    if positions is not True and positions is not False:
        length = sums.shape[0]
        sums = sums[torch.tensor([p % length for p in positions], dtype=torch.long)]
    return sums if per_example else sums.sum(-1)


# -- the phases every sweep goes through -----------------------------------------------------------------------
@dataclass(frozen=True)
class Cells:
    """How a sweep cuts each layer's activation into cells, and whether it keeps one value per example.

    The parameters every sweep shares (:func:`attribution.activation_patching`,
    :func:`attribution.attribution_patching`, :func:`attribution.path_patching`), documented here once. A sweep takes
    them as ``cells=Cells(...)`` or as its keywords of the same names (``positions=``, ``heads=``...), not both.
    A cell is one layer and, with ``positions``, one position, and with ``heads``, one head; the result has the axes
    ``(layer, [position], [head], [example])``.

    Attributes:
        positions: ``True``: one cell per position (axis 1 of the activation, or the ``t`` axis of
            ``head_pattern``; tokens for ``(batch, tokens, d)``); a sequence: those positions (negative ones count
            from the end); ``False``: all positions at once.
        heads: number of heads: one cell per head, the activation viewed through ``head_pattern`` with ``h=heads``.
        head_pattern: einops pattern whose right side names plain axes ``b`` (batch), ``h`` (heads) and, when
            positions are swept, ``t``; the default splits the last axis.
        per_example: keep one value per batch item (a trailing batch axis); ``metric`` then returns ``(batch,)``.

    Example:
        >>> from attribution import activation_patching
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        >>> by_head = Cells(positions=[-1], heads=2)
        >>> activation_patching(model, x, y, ["0", "1"], lambda out: out.sum(), cells=by_head, progress=False).shape
        torch.Size([2, 1, 2])
    """

    positions: bool | Sequence[int] = True
    heads: int | None = None
    head_pattern: str = DEFAULT_HEAD_PATTERN
    per_example: bool = False

    @property
    def pattern(self) -> str | None:
        """The einops view of the activation (only with heads)."""
        return self.head_pattern if self.heads else None

    @property
    def sizes(self) -> dict[str, int]:
        """The axis sizes ``pattern`` needs."""
        return {"h": self.heads} if self.heads else {}

    @property
    def axes(self) -> list[str]:
        """Axis names of the (viewed) activation."""
        return view_axes(self.pattern, self.positions is not False)

    def plan(self, names: list[str], acts: Recorded, model: nn.Module, site: str) -> tuple[list[Cell], tuple[int, ...]]:
        """The cells in row-major order and the result's shape.

        Checks positions and heads against ``acts``, and ``heads`` against a language model's config where the
        sites are its attention projections (:func:`attribution.models.check_heads`: on GQA, query and key/value
        heads differ, and a wrong count that happens to divide the activation would slice it silently wrong).
        """
        if self.heads is not None:
            check_heads(model, names, self.heads, site)
        return plan_cells(names, acts, self.positions, self.heads, self.head_pattern, self.axes)

    def index(self, cell: Cell, rows: slice = slice(None)) -> Index:
        """The index of ``cell`` in the (viewed) activation, for the given batch rows."""
        return cell_index(self.axes, rows, cell)

    def sums(self, product: torch.Tensor) -> torch.Tensor:
        """``product`` (shaped like the activation) summed over each cell (:func:`cell_sums`)."""
        return cell_sums(product, self.positions, self.heads, self.head_pattern, self.per_example)

    def metric(self, metric: Callable[[Any], torch.Tensor], output: Any, batch: int) -> torch.Tensor:
        """``metric(output)``, checked: a scalar, or ``(batch,)`` per example."""
        return checked_metric(metric, output, self.per_example, batch)

    def shaped(self, values: torch.Tensor, shape: tuple[int, ...], batch: int) -> torch.Tensor:
        """Flat cell values as the result: ``shape`` plus a trailing batch axis per example."""
        return values.reshape(*shape, *((batch,) if self.per_example else ()))

    def labelled(self, result: torch.Tensor, names: list[str], first: str = "layer") -> PatchingResult:
        """The final result with its axes named and labelled: ``first`` (module names), position, head, example."""
        return labelled(result, (first, names), self.positions, self.heads, self.per_example)


def chosen_cells(
    cells: Cells | None, positions: bool | Sequence[int], heads: int | None, head_pattern: str, per_example: bool
) -> Cells:
    """The sweep's cells: ``cells`` if given (then the four keywords must keep their defaults), else the keywords."""
    keywords = Cells(positions, heads, head_pattern, per_example)
    if cells is None:
        return keywords
    if not isinstance(cells, Cells):
        raise TypeError(f"`cells` must be a Cells(positions=..., heads=...); got {type(cells).__name__}")
    if keywords != Cells():
        raise TypeError(
            f"give the cells once: `cells`={cells} or the keywords `positions`, `heads`, `head_pattern`, "
            f"`per_example` ({keywords}), not both"
        )
    return cells


@dataclass(frozen=True)
class Inputs:
    """The two inputs of a sweep after the checks: the run the activations come from and the run that is patched."""

    model: nn.Module
    names: list[str]
    batch: int
    source: Any
    target: Any


def prepare(
    model: nn.Module, first: Any, second: Any, layers: ModuleTarget, what: tuple[str, str], *, swap: bool = False
) -> Inputs:
    """Validate and plan: the eager module, plain inputs of the same structure and shapes, the layers in order.

    ``first`` is the source of the activations and ``second`` the run that is patched, or the reverse with
    ``swap``; ``what`` names the two arguments in error messages (``("`clean`", "`corrupted`")``).
    """
    model = eager_module(model)
    first, second = plain(first, model), plain(second, model)
    check_same_shapes(first, second, what)
    names = [name for name, _ in ordered(model, layers)]
    source, target = (second, first) if swap else (first, second)
    return Inputs(model, names, batch_size(first), source, target)


def check_direction(direction: str) -> None:
    """Raise unless ``direction`` is ``"denoise"`` or ``"noise"``."""
    if direction not in ("denoise", "noise"):
        raise ValueError(f"`direction` must be 'denoise' or 'noise'; got {direction!r}")


def normalised(result: torch.Tensor, unpatched: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(result - unpatched) / (other - unpatched)``: 0 is the unpatched run, 1 the run the activations come from."""
    low, high = unpatched.float().cpu(), other.float().cpu()
    return (result - low) / (high - low)


def ran_more_often(name: str, calls: int, reference: str = "the reference run") -> RuntimeError:
    """The error of a module that runs more often in a patched run than in the run its activations come from."""
    return RuntimeError(
        f"{name!r} ran more often than in {reference} ({calls} call(s)): the runs of a sweep must call the same "
        "modules the same number of times (a model whose control flow depends on the input?)"
    )


def call_of(acts: Recorded, name: str, index: int, reference: str = "the reference run") -> torch.Tensor:
    """The recorded activation of ``name``'s ``index``-th call in a reference run."""
    calls = acts.calls[name]
    if index >= len(calls):
        raise ran_more_often(name, len(calls), reference)
    return calls[index]


def reference_run(
    run: HookedRun,
    inputs: Inputs,
    grid: Cells,
    site: Site,
    element: Element,
    metric: Callable[[Any], torch.Tensor],
    *,
    names: list[str] | None = None,
    what: str = "`layers`",
) -> tuple[Recorded, torch.Tensor]:
    """The unpatched source run: every call of the sites of ``names`` (default: the layers) recorded, its metric.

    Raises the one "did not run" error (naming ``what``) for a module that never ran.
    """
    names = inputs.names if names is None else names
    with record(inputs.model, names, site=site, element=element) as acts:
        value = grid.metric(metric, run.forward(inputs.source), inputs.batch)
    for name in names:
        if name not in acts:
            raise did_not_run(what, name)
    return acts, value
