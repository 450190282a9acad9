"""Sites: record the activations of named modules, patch them, and replace part of an activation (pure)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import einops
import torch
from torch import nn

from hooks import HookManager, ModuleTarget, resolve

from .._run import Element, Threads, eager_if_compiled, eager_module, hook_site

Site = Literal["output", "input"]
Index = tuple[Any, ...]


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


@contextmanager
def record(
    model: nn.Module,
    layers: ModuleTarget,
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
    check_site(site)
    check_threads(threads)
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
    check_site(site)
    check_threads(threads)
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


def check_threads(threads: str) -> None:
    """Raise unless ``threads`` is ``"current"`` or ``"all"``."""
    if threads not in ("current", "all"):
        raise ValueError(f"`threads` must be 'current' or 'all'; got {threads!r}")


def check_site(site: str) -> None:
    """Raise unless ``site`` is ``"output"`` or ``"input"``."""
    if site not in ("output", "input"):
        raise ValueError(f"`site` must be 'output' or 'input'; got {site!r}")
