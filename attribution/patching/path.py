"""Path patching: the effect of one sender on the metric through chosen receivers only.

`Wang et al. 2022 <https://arxiv.org/abs/2211.00593>`_ (the IOI circuit, appendix B) and `Goldowsky-Dill et al. 2023
<https://arxiv.org/abs/2304.05969>`_. Activation patching measures everything a site does downstream; path patching
keeps only the paths that avoid the sites in ``freeze`` and end in the ``receivers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hooks import ModuleTarget

from .._progress import progress as progress_bar
from .._run import Element, HookedRun, did_not_run, hook_site, warn
from ._sweep import (
    DEFAULT_HEAD_PATTERN,
    Cell,
    Cells,
    Inputs,
    call_of,
    chosen_cells,
    normalised,
    ordered,
    prepare,
    ran_more_often,
    reference_run,
)
from .result import PatchingResult
from .sites import Index, Recorded, Site, check_site, record, replace


def path_patching(
    model: nn.Module,
    base: Any,
    source: Any,
    senders: ModuleTarget,
    receivers: ModuleTarget,
    metric: Callable[[Any], torch.Tensor],
    *,
    freeze: ModuleTarget | None = None,
    site: Literal["output", "input"] = "output",
    element: Element = None,
    cells: Cells | Sequence[Sequence[int]] | None = None,
    positions: bool | Sequence[int] = True,
    heads: int | None = None,
    head_pattern: str = DEFAULT_HEAD_PATTERN,
    per_example: bool = False,
    receiver_site: Literal["output", "input"] = "input",
    receiver_element: Element = None,
    receiver_positions: Sequence[int] | None = None,
    only: Sequence[Sequence[int]] | None = None,
    normalize: bool = False,
    progress: bool = True,
) -> PatchingResult:
    """Patch each sender cell from ``source`` into ``base`` along the paths that reach ``receivers`` only.

    ``base`` is the run being patched (the clean prompt, when asking what breaks it; the corrupted one when asking
    what restores it) and ``source`` the run the sender's activation comes from. For every sender cell (a layer of
    ``senders``, and a position and/or head, as in :func:`attribution.activation_patching`):

    1. *Sender run.* ``base`` runs with the cell's slice of the sender activation taken from the ``source`` run,
       while the ``site`` of every module in ``freeze`` keeps its value from the unpatched ``base`` run (every call;
       on the sender's own module, everything but the cell). The inputs (``receiver_site``) of the ``receivers``
       are recorded.
    2. *Receiver run.* A fresh ``base`` run with the receivers' inputs replaced by those recorded values (only at
       ``receiver_positions`` when given), and ``metric`` measured.

    So the change of the sender reaches the metric only through paths that pass no frozen site and end in a receiver:
    with the attention heads as ``freeze``, through the residual stream and the MLPs. A receiver is never frozen at
    its own receiving site. Costs two reference runs (``base`` and ``source``, recorded without autograd) and two
    forwards per cell.

    Args:
        model: any module (a ``torch.compile`` d model: the module it wraps); called as ``model(x)``, ``model(*x)``
            for a tuple or ``model(**x)`` for a mapping (a HuggingFace tokenizer's ``BatchEncoding`` as it is).
        base: the input whose run is patched.
        source: the input the sender activations come from, same structure and shapes.
        senders: modules whose ``site`` is patched (names, globs, modules), in the order of the result's first axis.
        receivers: modules whose ``receiver_site`` is recorded in the sender run and patched in the receiver run.
        metric: ``metric(model_output)``: a scalar tensor, or with ``per_example=True`` a ``(batch,)`` tensor.
        freeze: modules whose ``site`` (with ``element``) keeps its ``base`` value in the sender run. ``None`` (the
            default) freezes the senders themselves: with ``senders="layers.*.attn.o", heads=n`` every other head
            (Wang et al.'s choice). ``()`` freezes nothing (then, with all positions as receivers, this is
            activation patching).
        site: ``"output"`` or ``"input"`` (the first argument as called) of the senders and frozen modules.
        element: for tuple, mapping or ``ModelOutput`` sites, the tensor that is the site (an index or a name); for
            ``site="input"``, the argument (a position or a parameter name).
        cells: the sender cells as one value, :class:`~attribution.patching.Cells` (the four keywords below,
            documented there); not together with them. (A sequence of index tuples, the former meaning of ``cells``,
            is now ``only``: it still works, with a ``DeprecationWarning``.)
        positions: one cell per position (``True``), per listed position, or none (``False``): see ``Cells``.
        heads: one cell per head, the activation viewed through ``head_pattern``: see ``Cells``.
        head_pattern: the heads' view of the activation: see ``Cells``.
        per_example: keep one value per batch item (a trailing batch axis): see ``Cells``.
        receiver_site: ``"input"`` (default) or ``"output"`` of the receivers.
        receiver_element: ``element`` for the receivers' site.
        receiver_positions: positions (axis 1) of the receivers' activations to patch; ``None``: all.
        only: run only these cells, given as indices into the result (``(sender, head)`` for a ``(senders, heads)``
            result, ``(sender, position_index, head)`` for ``(senders, positions, heads)``...); the other cells are
            NaN. For confirming a few cells that a screen such as attribution patching ranked first.
        normalize: return ``(patched - m_base) / (m_source - m_base)``: 0 is the ``base`` run, 1 the ``source`` run.
        progress: show a tqdm progress bar on a terminal (it appears once the call has run for a second).

    Returns:
        A float32 CPU :class:`~attribution.patching.PatchingResult` (first axis ``sender``) shaped like
        :func:`attribution.activation_patching`'s: ``(senders, positions)``, ``(senders,)``, ``(senders, heads)`` or
        ``(senders, positions, heads)``, plus a trailing batch axis with ``per_example=True``: the metric after each
        path patch.

    Raises:
        TypeError: ``cells`` together with one of the keywords it replaces, or ``cells`` and ``only`` as index tuples.
        ValueError: ``base`` and ``source`` differ in structure or shape (before any forward); ``metric`` is not a
            scalar (or ``(batch,)`` with ``per_example``), a sender, frozen module or receiver never runs, ``heads``
            do not divide the activation.
        IndexError: a position out of range.

    Example:
        >>> class Toy(torch.nn.Module):  # s = x + a(x) + b(x + a(x)), with a(u) = 2u and b(u) = 3u
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b, self.r = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
        ...     def forward(self, x):
        ...         h1 = self.a(2 * x)
        ...         h2 = self.b(3 * (x + h1))
        ...         return self.r(x + h1 + h2)
        >>> base, source = torch.ones(1, 1), torch.full((1, 1), 2.0)
        >>> path_patching(Toy(), base, source, ["a", "b"], "r", lambda out: out.sum(), positions=False)
        tensor([14., 21.])
    """
    check_site(site)
    check_site(receiver_site)
    inputs = prepare(model, base, source, senders, ("`base`", "`source`"), swap=True)  # the target run is `base`
    receiving = _Sites(receiver_site, receiver_element, [name for name, _ in ordered(inputs.model, receivers)])
    frozen = _frozen(inputs, freeze, receiving if (site, element) == (receiver_site, receiver_element) else None)
    sending = _Sites(site, element, list(dict.fromkeys(inputs.names + frozen)))
    cells, only = _deprecated_cells(cells, only)
    grid = chosen_cells(cells, positions, heads, head_pattern, per_example)
    with HookedRun(inputs.model, "path-patching") as run:
        with (
            record(inputs.model, sending.names, site=site, element=element) as base_acts,
            record(inputs.model, receiving.names, site=receiver_site, element=receiver_element) as base_received,
        ):
            base_metric = grid.metric(metric, run.forward(inputs.target), inputs.batch)
        source_acts, source_metric = reference_run(run, inputs, grid, site, element, metric, what="`senders`")
        for what, names, seen in (("`freeze`", frozen, base_acts), ("`receivers`", receiving.names, base_received)):
            for name in names:
                if name not in seen:
                    raise did_not_run(what, name)
        every, shape = grid.plan(inputs.names, source_acts, inputs.model, site)
        paths = _Paths(inputs, grid, frozen, (base_acts, source_acts), receiver_positions)
        hook_site(run.group, sending.names, site, element, paths.sender_site)
        hook_site(run.group, receiving.names, receiver_site, receiver_element, paths.receiver)
        chosen = range(len(every)) if only is None else _chosen(only, shape)
        values = torch.full((len(every), *((inputs.batch,) if grid.per_example else ())), float("nan"))
        for i in progress_bar(chosen, desc="path patching", enabled=progress):
            values[i] = paths.run(run, every[i], metric)
    result = grid.shaped(values, shape, inputs.batch)
    result = normalised(result, base_metric, source_metric) if normalize else result  # 0: the base run, 1: source
    return grid.labelled(result, inputs.names, "sender")


@dataclass(frozen=True)
class _Sites:
    """One kind of site of a path-patching run: ``site`` (and ``element``) of the modules ``names``."""

    site: Site
    element: Element
    names: list[str]


def _frozen(inputs: Inputs, freeze: ModuleTarget | None, receiving: _Sites | None) -> list[str]:
    """The modules whose site keeps its base value: the senders by default; never a receiver at its own site."""
    if freeze is None:
        frozen = list(inputs.names)
    elif isinstance(freeze, (list, tuple)) and not freeze:
        frozen = []
    else:
        frozen = [name for name, _ in ordered(inputs.model, freeze)]
    if receiving is not None:
        frozen = [name for name in frozen if name not in receiving.names]  # receivers receive; they are not frozen
    return frozen


class _Paths:
    """The two runs of each sender cell, and the hooks that make them.

    The sender run freezes the frozen sites, patches the cell and records the receivers; the receiver run patches
    the receivers' recorded values in.
    """

    def __init__(
        self,
        inputs: Inputs,
        grid: Cells,
        frozen: list[str],
        recorded: tuple[Recorded, Recorded],
        receiver_positions: Sequence[int] | None,
    ) -> None:
        self.inputs, self.grid, self.frozen = inputs, grid, set(frozen)
        self.base_acts, self.source_acts = recorded
        self.receiver_index: Index = () if receiver_positions is None else (slice(None), list(receiver_positions))
        self.stage: Literal["sender", "receiver"] | None = None
        self.cell: Cell | None = None
        self.received: dict[str, list[torch.Tensor]] = {}

    def run(self, run: HookedRun, cell: Cell, metric: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The metric after patching ``cell`` along the paths to the receivers."""
        self.received.clear()
        self.stage, self.cell = "sender", cell
        try:
            run.forward(self.inputs.target)
            self.stage = "receiver"
            return self.grid.metric(metric, run.forward(self.inputs.target), self.inputs.batch).float().cpu()
        finally:
            self.stage, self.cell = None, None

    def sender_site(self, current: torch.Tensor, name: str, call_index: int) -> torch.Tensor | None:
        """In the sender run: frozen sites take their base value, the cell's slice its source value."""
        if self.stage != "sender" or self.cell is None:
            return None
        new = current
        if name in self.frozen:
            new = call_of(self.base_acts, name, call_index).to(current.dtype).clone()
        if name == self.inputs.names[self.cell.layer]:
            source = call_of(self.source_acts, name, call_index)
            new = replace(new, source, self.grid.index(self.cell), pattern=self.grid.pattern, sizes=self.grid.sizes)
        return None if new is current else new

    def receiver(self, current: torch.Tensor, name: str, call_index: int) -> torch.Tensor | None:
        """Recorded in the sender run; patched in (at ``receiver_positions``) in the receiver run."""
        if self.stage == "sender":
            calls = self.received.setdefault(name, [])
            del calls[call_index:]
            calls.append(current.detach().clone())
        elif self.stage == "receiver":
            sent = self.received[name]
            if call_index >= len(sent):
                raise ran_more_often(name, len(sent), "the sender run")
            return replace(current, sent[call_index], self.receiver_index)
        return None


def _deprecated_cells(
    cells: Cells | Sequence[Sequence[int]] | None, only: Sequence[Sequence[int]] | None
) -> tuple[Cells | None, Sequence[Sequence[int]] | None]:
    """``(cells, only)``, with index tuples given as ``cells`` (the old spelling) moved to ``only``, warned."""
    if not isinstance(cells, (list, tuple)):  # None, a Cells, or something chosen_cells refuses
        return cells, only  # type: ignore[return-value]
    if only is not None:
        raise TypeError("give the cells to run once, as `only`; `cells` is for Cells(positions=..., heads=...)")
    warn(
        "`cells` as index tuples is deprecated: pass them as `only=` (`cells` now takes "
        "Cells(positions=..., heads=...))",
        DeprecationWarning,
    )
    return None, cells


def _chosen(only: Sequence[Sequence[int]], shape: tuple[int, ...]) -> list[int]:
    """Flat (row-major) indices of ``only``, index tuples into a result of ``shape``; checked."""
    flat = set()
    for cell in only:
        index = tuple(int(i) for i in cell)
        if len(index) != len(shape) or not all(-n <= i < n for i, n in zip(index, shape, strict=True)):
            raise IndexError(f"`only` entry {tuple(cell)} is not an index into the result's shape {shape}")
        position = 0
        for i, n in zip(index, shape, strict=True):
            position = position * n + i % n
        flat.add(position)
    return sorted(flat)
