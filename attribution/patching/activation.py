"""Activation patching: patch one cell at a time from one run into the other and measure the metric each time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Literal

import torch
from torch import nn

from hooks import ModuleTarget, hooked_modules

from .._paired import repeat_batch, take_rows
from .._progress import progress as progress_bar
from .._replay import Plan, Replay, replaying
from .._run import Element, HookedRun, hook_site
from ._sweep import (
    DEFAULT_HEAD_PATTERN,
    Cell,
    Cells,
    Inputs,
    call_of,
    check_direction,
    chosen_cells,
    normalised,
    prepare,
    reference_run,
)
from .result import PatchingResult
from .sites import Recorded, Site, check_site, replace


def activation_patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    layers: ModuleTarget,
    metric: Callable[[Any], torch.Tensor],
    *,
    site: Site = "output",
    element: Element = None,
    cells: Cells | None = None,
    positions: bool | Sequence[int] = True,
    heads: int | None = None,
    head_pattern: str = DEFAULT_HEAD_PATTERN,
    per_example: bool = False,
    normalize: bool = False,
    direction: Literal["denoise", "noise"] = "denoise",
    cells_per_forward: int = 1,
    reuse: bool = True,
    progress: bool = True,
) -> PatchingResult:
    """Patch one site at a time from one run into the other and measure ``metric`` each time.

    Denoising (default): the clean input runs once and its activations are recorded; then, for every cell (a layer,
    and a position and/or head), the corrupted input runs with that one clean activation patched in. Noising does
    the reverse (corrupted activations into the clean run). Runs without autograd, in eval mode.

    Args:
        model: any module; called as ``model(x)``, ``model(*x)`` for a tuple or ``model(**x)`` for a dict.
        clean: the clean input.
        corrupted: the corrupted input, same structure and shapes.
        layers: modules whose site is patched (names, globs, modules), in the order of the result's first axis.
        metric: ``metric(model_output)``: a scalar tensor, or with ``per_example=True`` a ``(batch,)`` tensor.
        site: ``"output"`` of the modules, or their first positional ``"input"`` (the residual stream before a
            block is the input of that block).
        element: for modules returning tuples, which element is the site.
        cells: the cells of the sweep as one value, :class:`~attribution.patching.Cells` (the four keywords
            below, documented there); not together with them.
        positions: one cell per position (``True``), per listed position, or none (``False``): see ``Cells``.
        heads: one cell per head, the activation viewed through ``head_pattern``: see ``Cells``.
        head_pattern: the heads' view of the activation: see ``Cells``.
        per_example: keep one value per batch item (a trailing batch axis): see ``Cells``.
        normalize: return ``(patched - corrupted) / (clean - corrupted)`` when denoising (0 is the corrupted run, 1
            the clean one) and ``(patched - clean) / (corrupted - clean)`` when noising; costs one more forward.
        direction: ``"denoise"`` (clean into corrupted) or ``"noise"`` (corrupted into clean).
        cells_per_forward: run this many cells in one batched forward (the input repeated along the batch axis;
            for GPUs, and for models without batch coupling).
        reuse: in each cell's forward, the module calls that finish before the cell's site return a copy of what
            they returned in an unpatched run instead of running again (same results, bitwise; one extra forward
            to record them). Used with ``cells_per_forward=1`` where it is safe: not for calls whose output is a
            view of their input or of the model's state, that contain a module also called elsewhere, or that
            carry hooks of their own; not at all for a model that draws random numbers or with global module
            hooks; and a check run must reproduce the model's output, else a warning says so and every call runs.
            ``False`` runs every call.
        progress: show a tqdm progress bar on a terminal (it appears once the call has run for a second).

    Returns:
        A float32 CPU :class:`~attribution.patching.PatchingResult` (a tensor that carries its axes' labels):
        ``(layers, positions)``, ``(layers,)``, ``(layers, heads)`` or ``(layers, positions, heads)``, plus a
        trailing batch axis with ``per_example=True``.

    Raises:
        TypeError: ``cells`` together with one of the four keywords it replaces.
        ValueError: ``clean`` and ``corrupted`` differ in structure or shape (before any forward); ``metric`` does not
            return a scalar (or a ``(batch,)`` vector with ``per_example``), a layer never runs, or ``heads`` does
            not divide the activation (after the reference run, before the sweep).
        IndexError: a position is out of range (after the reference run, before the sweep).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        >>> result = activation_patching(model, clean, corrupted, ["0", "1"], lambda out: out[:, -1].mean(),
        ...                              progress=False)
        >>> result.shape
        torch.Size([2, 3])
    """
    check_site(site)
    check_direction(direction)
    if cells_per_forward < 1:
        raise ValueError(f"`cells_per_forward` must be at least 1; got {cells_per_forward}")
    inputs = prepare(model, clean, corrupted, layers, ("`clean`", "`corrupted`"), swap=direction == "noise")
    grid = chosen_cells(cells, positions, heads, head_pattern, per_example)
    replayable = reuse and cells_per_forward == 1
    hooked = {id(m) for m in hooked_modules(inputs.model)} if replayable else None  # the user's hooks, before ours
    with HookedRun(inputs.model, "activation-patching") as run, ExitStack() as stack:
        source, source_metric = reference_run(run, inputs, grid, site, element, metric)
        every, shape = grid.plan(inputs.names, source, inputs.model, site)
        target_output, plans, replay = None, None, None
        if hooked is not None:  # the unpatched target run, traced to replay the calls before each site
            sites = [(name, site) for name in inputs.names]
            target_output, plans, replay = stack.enter_context(
                replaying(inputs.model, run.forward, inputs.target, sites, hooked)
            )
        elif normalize:
            target_output = run.forward(inputs.target)
        target_metric = grid.metric(metric, target_output, inputs.batch) if normalize else None
        sweep = _Sweep(inputs, source, grid, every)
        hook_site(run.group, inputs.names, site, element, sweep.patch)
        values = sweep.run(run, metric, cells_per_forward, (replay, plans), progress)
    result = grid.shaped(values, shape, inputs.batch)
    result = result if target_metric is None else normalised(result, target_metric, source_metric)
    return grid.labelled(result, inputs.names)


class _Sweep:
    """The cell runs: one forward per chunk of cells, each cell's slice of the source activation patched in."""

    def __init__(self, inputs: Inputs, source: Recorded, grid: Cells, cells: list[Cell]) -> None:
        self.inputs, self.source, self.grid, self.cells = inputs, source, grid, cells
        self.chunk: list[Cell] = []  # the cells of the forward being run, in batch-row order

    def patch(self, current: torch.Tensor, name: str, call_index: int) -> torch.Tensor:
        """The hook at every site: patch the cells of this layer (a module called several times: each call)."""
        layer, batch = self.inputs.names.index(name), self.inputs.batch
        recorded = call_of(self.source, name, call_index)
        for chunk, cell in enumerate(self.chunk):
            if cell.layer == layer:
                rows = slice(chunk * batch, (chunk + 1) * batch)
                index, source_index = self.grid.index(cell, rows), self.grid.index(cell)
                current = replace(
                    current,
                    recorded,
                    index,
                    pattern=self.grid.pattern,
                    sizes=self.grid.sizes,
                    source_index=source_index,
                )
        return current

    def run(
        self,
        run: HookedRun,
        metric: Callable[[Any], torch.Tensor],
        per_forward: int,
        replaying: tuple[Replay | None, list[Plan] | None],
        progress: bool,
    ) -> torch.Tensor:
        """Every cell's metric, ``(cells, [batch])``; ``per_forward`` cells share one forward along the batch axis."""
        batch, replay, plans = self.inputs.batch, *replaying
        values = torch.empty(len(self.cells), *((batch,) if self.grid.per_example else ()))
        try:
            for start in progress_bar(
                range(0, len(self.cells), per_forward), desc="activation patching", enabled=progress
            ):
                self.chunk = self.cells[start : start + per_forward]
                if replay is not None and plans is not None:
                    replay.use(plans[self.chunk[0].layer])
                stacked = len(self.chunk)
                out = run.forward(repeat_batch(self.inputs.target, stacked, batch))
                for chunk in range(stacked):
                    part = (
                        take_rows(out, slice(chunk * batch, (chunk + 1) * batch), batch * stacked)
                        if stacked > 1
                        else out
                    )
                    values[start + chunk] = self.grid.metric(metric, part, batch).float().cpu()
        finally:
            self.chunk = []
        return values
