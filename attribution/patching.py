"""Activation patching for any ``nn.Module``: record activations, patch them in, sweep over layers/positions/heads.

A *site* is the output (or the first input) of a named module; for modules that return tuples, mappings or
HuggingFace ``ModelOutput`` objects, ``element`` picks the tensor (an attention block returning ``(out, weights)``:
``element=0``; a ``ModelOutput``: ``element="last_hidden_state"``). For ``site="input"`` the site is the module's
first argument as called (positional, else the first keyword argument), and ``element`` names another one (a
position, or a parameter name such as ``"hidden_states"``). Positions index the activation's axis 1
(``(batch, tokens, ...)``); heads are read through an einops pattern that splits the last axis,
``"b t (h d) -> b t h d"`` by default.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import einops
import torch
from torch import nn
from torch.utils import _pytree as pytree
from tqdm.auto import tqdm

from hooks import HookManager, resolve
from hooks import ModuleTarget as Target

from ._inputs import batch_size, batched
from ._run import Element, HookedRun, Threads, did_not_run, eager_if_compiled, eager_module, hook_site

Site = Literal["output", "input"]
Index = tuple[Any, ...]
DEFAULT_HEAD_PATTERN = "b t (h d) -> b t h d"


# -- pure helpers ----------------------------------------------------------------------------------------------
def _inverse(pattern: str) -> str:
    left, right = pattern.split("->")
    return f"{right.strip()} -> {left.strip()}"


def replace(
    activation: torch.Tensor,
    source: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    index: Index = (),
    *,
    pattern: str | None = None,
    sizes: Mapping[str, int] | None = None,
    source_index: Index | None = None,
) -> torch.Tensor:
    """A copy of ``activation`` with ``activation[index]`` taken from ``source`` (viewed through ``pattern``).

    Args:
        activation: the tensor to patch.
        source: a tensor shaped like ``activation`` (its ``source_index`` part is copied), or a function of the
            (viewed) activation returning the new values of the whole view.
        index: where to patch, in the viewed tensor (``()`` patches everything).
        pattern: an einops pattern that views the activation, e.g. ``"b t (h d) -> b t h d"``.
        sizes: axis sizes the pattern needs (``{"h": 8}``).
        source_index: where to read in ``source`` (default: ``index``).

    Example:
        >>> a, b = torch.zeros(1, 2, 4), torch.ones(1, 2, 4)
        >>> replace(a, b, (slice(None), 1, 0), pattern="b t (h d) -> b t h d", sizes={"h": 2})
        tensor([[[0., 0., 0., 0.],
                 [1., 1., 0., 0.]]])
    """
    sizes = dict(sizes or {})
    view = einops.rearrange(activation, pattern, **sizes) if pattern else activation
    if callable(source) and not isinstance(source, torch.Tensor):
        new = source(view)
        if not isinstance(new, torch.Tensor) or new.shape != view.shape:
            raise ValueError(
                f"a patch function must return a tensor of shape {tuple(view.shape)}; got "
                f"{tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__}"
            )
        if index:
            patched = view.clone()
            patched[index] = new[index]
            new = patched
    else:
        src = einops.rearrange(source, pattern, **sizes) if pattern else source
        new = view.clone()
        new[index] = src[index if source_index is None else source_index].to(new.dtype)
    if not pattern:
        return new
    restored: torch.Tensor = einops.rearrange(new, _inverse(pattern), **{k: v for k, v in sizes.items()})
    return restored


# -- record and patch ------------------------------------------------------------------------------------------
@contextmanager
def record(
    model: nn.Module,
    layers: Target,
    *,
    site: Site = "output",
    element: Element = None,
    threads: Threads = "current",
) -> Iterator[Recorded]:
    """Record the activations of ``layers`` during the runs inside the ``with`` block.

    Yields a dict ``name -> tensor`` (detached copies, taken before any later in-place operation), filled as the
    model runs; a module that runs several times in one forward keeps its last call there, and every call is in
    ``acts.calls[name]`` (a list, in call order, restarted at each forward of the model).

    Args:
        model: the model (a ``torch.compile`` d model: the module it wraps).
        layers: module names, globs, module objects, or a list of them.
        site: ``"output"`` or ``"input"`` (see the module documentation).
        element: for tuple, mapping or ``ModelOutput`` sites, the tensor to record (an index or a name); for
            ``site="input"``, the argument (a position or a parameter name).
        threads: ``"current"`` records the forwards of this thread only; ``"all"`` those of every thread (needed
            when the model runs in another thread: a thread pool, a web handler, ``nn.DataParallel``).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(inplace=True))
        >>> with record(model, "0") as acts:
        ...     _ = model(torch.randn(2, 3))
        >>> sorted(acts), acts["0"].shape
        (['0'], torch.Size([2, 3]))
    """
    _check_site(site)
    _check_threads(threads)
    acts = Recorded()

    def keep(tensor: torch.Tensor, name: str, call: int) -> None:
        copy = tensor.detach().clone()  # the module's own tensor may be changed in place later
        acts[name] = copy
        calls = acts.calls.setdefault(name, [])
        del calls[call:]
        calls.append(copy)

    with eager_if_compiled(model), HookManager(eager_module(model)) as mgr:
        hook_site(mgr.group("record", threads=threads), layers, site, element, keep)
        yield acts


class Recorded(dict[str, torch.Tensor]):
    """What :func:`record` yields: ``name -> last call's tensor``, and ``calls[name]``, every call in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[torch.Tensor]] = {}


@dataclass
class Patch:
    """What to put at one site.

    Attributes:
        value: a tensor shaped like the site's activation (for example a recorded clean activation), or a function
            of the (viewed) activation returning its replacement.
        index: where to patch in the (viewed) activation, e.g. ``(slice(None), 3)`` for position 3; ``()`` = all.
        pattern: einops pattern viewing the activation before indexing, e.g. ``"b t (h d) -> b t h d"``.
        sizes: axis sizes for ``pattern`` (``{"h": 8}``).
        element: for tuple, mapping or ``ModelOutput`` sites, which tensor is the site (an index or a name); for
            ``site="input"``, which argument (a position or a parameter name).
    """

    value: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
    index: Index = ()
    pattern: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    element: Element = None


@contextmanager
def patch(
    model: nn.Module,
    patches: Mapping[str, Patch | torch.Tensor | Callable[[torch.Tensor], torch.Tensor]],
    *,
    site: Site = "output",
    threads: Threads = "current",
) -> Iterator[None]:
    """Replace the activations of named modules during the runs inside the ``with`` block.

    Args:
        model: the model.
        patches: module name -> :class:`Patch`, or directly a tensor or a function of the activation.
        site: patch the module's ``"output"`` or its ``"input"`` (see the module documentation).
        threads: ``"current"`` patches the forwards of this thread only; ``"all"`` those of every thread (needed
            when the model runs in another thread: a thread pool, a web handler, ``nn.DataParallel``).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> with patch(model, {"0": lambda a: a * 0}), torch.no_grad():
        ...     model(torch.randn(1, 2)).abs()
        tensor([[0., 0.]])
    """
    _check_site(site)
    _check_threads(threads)
    model = eager_module(model)
    specs = {
        name: p if isinstance(p, Patch) else Patch(p)
        for key, p in patches.items()
        for name, _ in resolve(model, key, what="`patches` key")  # names, globs and modules all expand to names
    }

    def patched(current: torch.Tensor, name: str, call: int) -> torch.Tensor:
        spec = specs[name]
        return replace(current, spec.value, spec.index, pattern=spec.pattern, sizes=spec.sizes)

    with eager_if_compiled(model), HookManager(model) as mgr:
        group = mgr.group("patch", threads=threads)
        for element in dict.fromkeys(spec.element for spec in specs.values()):
            names = [name for name, spec in specs.items() if spec.element == element]
            hook_site(group, names, site, element, patched)
        yield


def _check_threads(threads: str) -> None:
    if threads not in ("current", "all"):
        raise ValueError(f"`threads` must be 'current' or 'all'; got {threads!r}")


def _check_site(site: str) -> None:
    if site not in ("output", "input"):
        raise ValueError(f"`site` must be 'output' or 'input'; got {site!r}")


# -- the sweep -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Cell:
    layer: int
    position: int | None
    head: int | None


def activation_patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    layers: Target,
    metric: Callable[[Any], torch.Tensor],
    *,
    site: Site = "output",
    element: Element = None,
    positions: bool | Sequence[int] = True,
    heads: int | None = None,
    head_pattern: str = DEFAULT_HEAD_PATTERN,
    per_example: bool = False,
    normalize: bool = False,
    direction: Literal["denoise", "noise"] = "denoise",
    cells_per_forward: int = 1,
    progress: bool = True,
) -> torch.Tensor:
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
        positions: ``True``: one cell per position (axis 1 of the activation); a sequence: those positions;
            ``False``: all positions at once.
        heads: number of heads: one cell per head, the activation viewed through ``head_pattern``.
        head_pattern: einops pattern splitting the last axis into heads, with ``h`` the head axis.
        per_example: keep one value per batch item (a trailing batch axis).
        normalize: return ``(patched - corrupted) / (clean - corrupted)`` when denoising (0 is the corrupted run, 1
            the clean one) and ``(patched - clean) / (corrupted - clean)`` when noising; costs one more forward.
        direction: ``"denoise"`` (clean into corrupted) or ``"noise"`` (corrupted into clean).
        cells_per_forward: run this many cells in one batched forward (the input repeated along the batch axis;
            for GPUs, and for models without batch coupling).
        progress: show a tqdm progress bar.

    Returns:
        ``(layers, positions)``, ``(layers,)``, ``(layers, heads)`` or ``(layers, positions, heads)``, plus a
        trailing batch axis with ``per_example=True``.

    Raises:
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
    _check_site(site)
    if direction not in ("denoise", "noise"):
        raise ValueError(f"`direction` must be 'denoise' or 'noise'; got {direction!r}")
    if cells_per_forward < 1:
        raise ValueError(f"`cells_per_forward` must be at least 1; got {cells_per_forward}")
    model = eager_module(model)
    clean, corrupted = _plain(clean, model), _plain(corrupted, model)
    _check_same_shapes(clean, corrupted)
    names = [name for name, _ in _ordered(model, layers)]
    batch = batch_size(clean)

    source_input, target_input = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    with HookedRun(model, "activation-patching") as run:
        # the run whose activations are patched in; the other unpatched run only when normalising needs its metric
        with record(model, names, site=site, element=element) as source:
            source_metric = _checked_metric(metric, run.forward(source_input), per_example, batch)
        for name in names:
            if name not in source:
                raise did_not_run("`layers`", name)
        target_metric = _checked_metric(metric, run.forward(target_input), per_example, batch) if normalize else None
        axes = _view_axes(head_pattern if heads else None, positions is not False)
        cells, shape = _cells(names, source, positions, heads, head_pattern, axes)
        sizes = {"h": heads} if heads else {}
        values = torch.empty(len(cells), *((batch,) if per_example else ()))

        plan: list[tuple[int, _Cell]] = []  # (chunk, cell) of the forward being run

        def patch_site(current: torch.Tensor, name: str, call_index: int) -> torch.Tensor:
            layer = names.index(name)
            calls = source.calls[name]
            if call_index >= len(calls):
                raise RuntimeError(f"{name!r} ran more often than in the reference run ({len(calls)} call(s))")
            for chunk, cell in plan:
                if cell.layer != layer:
                    continue
                rows = slice(chunk * batch, (chunk + 1) * batch)
                current = replace(
                    current,
                    calls[call_index],  # a module that runs several times gets each of its calls back
                    _cell_index(axes, rows, cell),
                    pattern=head_pattern if heads else None,
                    sizes=sizes,
                    source_index=_cell_index(axes, slice(None), cell),
                )
            return current

        hook_site(run.group, names, site, element, patch_site)
        steps = range(0, len(cells), cells_per_forward)
        for start in tqdm(steps, desc="activation patching", disable=not progress, leave=False):
            chunk_cells = cells[start : start + cells_per_forward]
            plan[:] = list(enumerate(chunk_cells))
            out = run.forward(_repeat(target_input, len(chunk_cells), batch))
            for chunk, _ in plan:
                rows = slice(chunk * batch, (chunk + 1) * batch)
                part = _rows(out, rows, batch * len(chunk_cells)) if len(chunk_cells) > 1 else out
                values[start + chunk] = _checked_metric(metric, part, per_example, batch).float().cpu()
        plan.clear()

    result = values.view(*shape, *((batch,) if per_example else ()))
    if target_metric is not None:  # 0 = the unpatched run, 1 = the run the activations come from
        base, top = target_metric.float().cpu(), source_metric.float().cpu()
        result = (result - base) / (top - base)
    return result


def _ordered(model: nn.Module, layers: Target) -> list[tuple[str, nn.Module]]:
    """Resolve layers keeping the user's order for explicit lists (globs expand in model order)."""
    if isinstance(layers, (list, tuple)):
        pairs = [pair for item in layers for pair in resolve(model, item, what="`layers`")]
        return list({id(m): (n, m) for n, m in reversed(pairs)}.values())[::-1]
    return resolve(model, layers, what="`layers`")


def _view_axes(pattern: str | None, positions: bool) -> list[str]:
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


def _cell_index(axes: list[str], rows: slice, cell: _Cell) -> Index:
    """The index of one cell in the (viewed) activation, for the given batch rows."""
    index: list[Any] = [slice(None)] * len(axes)
    index[axes.index("b")] = rows
    if cell.position is not None:
        index[axes.index("t")] = cell.position
    if cell.head is not None:
        index[axes.index("h")] = cell.head
    used = [i for i, v in enumerate(index) if v != slice(None)]
    return tuple(index[: used[-1] + 1]) if used else ()


def _cells(
    names: list[str],
    acts: Recorded,
    positions: bool | Sequence[int],
    heads: int | None,
    head_pattern: str,
    axes: list[str],
) -> tuple[list[_Cell], tuple[int, ...]]:
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
    cells = [_Cell(layer, p, h) for layer, p, h in itertools.product(range(len(names)), pos, head_list)]
    shape = (len(names),) + ((len(pos),) if positions is not False else ()) + ((heads,) if heads else ())
    return cells, shape


def _plain(inputs: Any, model: nn.Module) -> Any:
    """Inputs as plain containers (a ``BatchFeature`` as a dict), a single image with a batch axis."""
    inputs = batched(inputs, model, images=False).inputs
    return dict(inputs) if isinstance(inputs, Mapping) else inputs


def _check_same_shapes(clean: Any, corrupted: Any) -> None:
    a, spec_a = pytree.tree_flatten(clean)
    b, spec_b = pytree.tree_flatten(corrupted)
    if spec_a != spec_b:
        raise ValueError(f"`clean` and `corrupted` must have the same structure; got {spec_a} and {spec_b}")
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) and (not isinstance(y, torch.Tensor) or x.shape != y.shape):
            raise ValueError(
                f"`clean` and `corrupted` must have the same shapes; got {tuple(x.shape)} and "
                f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
            )
    if not any(isinstance(x, torch.Tensor) for x in a):
        raise TypeError("`clean` must be a tensor, or a tuple/dict of model inputs holding tensors")


def _repeat(inputs: Any, times: int, batch: int) -> Any:
    """The inputs stacked ``times`` along the batch axis; tensors whose first axis is not the batch stay as they are."""
    if times == 1:
        return inputs

    def stack(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x.repeat(times, *[1] * (x.dim() - 1))
        return x

    return pytree.tree_map(stack, inputs)


def _rows(output: Any, rows: slice, stacked: int) -> Any:
    """The rows of one cell in a stacked output (leaves whose first axis is the stacked batch)."""

    def take(x: Any) -> Any:
        return x[rows] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == stacked else x

    return pytree.tree_map(take, output)


def _checked_metric(metric: Callable[[Any], torch.Tensor], output: Any, per_example: bool, batch: int) -> torch.Tensor:
    value = metric(output)
    expected = (batch,) if per_example else ()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        want = f"a ({batch},) tensor, one value per example" if per_example else "a scalar tensor"
        raise ValueError(
            f"`metric` must return {want}; got {got}" + (" (pass per_example=True?)" if got == (batch,) else "")
        )
    return value
