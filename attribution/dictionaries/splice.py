"""Splicing: a dictionary as one hook group, its features and error term reachable as sites of the model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookManager, resolve

from .._run import (
    Element,
    SiteTypeError,
    SiteValueError,
    Threads,
    eager_if_compiled,
    eager_module,
    hook_site,
    put,
    select,
)
from .modules import SAE, Dictionary, Transcoder, reconstruct

CHILD = "dictionary"


class Spliced(nn.Module):
    """The module attached as ``<site>.dictionary`` while a splice is active.

    Calling it with the site's value ``x`` (and the tensor the dictionary reads, ``source``) returns the spliced value,
    computed through its two children, identity modules that are the sites ``<site>.dictionary.features`` and
    ``<site>.dictionary.error``. The dictionary itself is held outside the module tree, so that its weights never
    become parameters of the model.
    """

    def __init__(self, dictionary: Dictionary, name: str, *, error: bool) -> None:
        super().__init__()
        self.features = nn.Identity()
        self.error = nn.Identity()
        self._dictionary = [dictionary]  # in a list: not registered as a child
        self._name = name
        self._with_error = error

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The spliced value of the site (see :func:`splice`)."""
        dictionary = self._dictionary[0]
        self._check(x, source)
        src = source.to(device=dictionary.W_enc.device, dtype=dictionary.W_enc.dtype)
        clean = dictionary.encode(src)
        features = self.features(clean)
        r = reconstruct(dictionary, features, src).to(device=x.device, dtype=x.dtype)
        if not self._with_error:
            zero = torch.zeros_like(r)
            e = self.error(zero)
            return r if e is zero else r + e
        if features is clean:
            r0 = r
        else:
            with torch.no_grad():
                r0 = reconstruct(dictionary, clean, src).to(device=x.device, dtype=x.dtype)
        e0 = (x - r0).detach()
        e = self.error(e0)
        if features is clean and e is e0 and not r.requires_grad:
            return x  # nothing patched and no gradient wanted: bitwise the original
        out = x.detach() + (r - r0.detach())  # x itself while nothing is patched; the gradient through r
        return out if e is e0 else out + (e - e0)

    def _check(self, x: torch.Tensor, source: torch.Tensor) -> None:
        dictionary = self._dictionary[0]
        kind = type(dictionary).__name__
        if not (x.is_floating_point() and source.is_floating_point()):
            raise SiteTypeError(f"the site {self._name!r} holds a {x.dtype} tensor; a dictionary needs floating point")
        if source.shape[-1] != dictionary.d_in:
            what = "input" if isinstance(dictionary, Transcoder) else "activation"
            raise SiteValueError(
                f"the {kind} spliced at {self._name!r} reads vectors of width d_in={dictionary.d_in}, but the site's "
                f"{what} has shape {tuple(source.shape)} (width {source.shape[-1]}): splice a dictionary trained on "
                "this site, or choose the site it was trained on"
            )
        if x.shape[-1] != dictionary.d_out:
            raise SiteValueError(
                f"the {kind} spliced at {self._name!r} writes vectors of width d_out={dictionary.d_out}, but the "
                f"site's output has shape {tuple(x.shape)} (width {x.shape[-1]})"
            )


@contextmanager
def splice(
    model: nn.Module,
    dictionaries: Mapping[str, Dictionary],
    *,
    error: bool = True,
    site: Literal["output", "input"] = "output",
    element: Element = None,
    threads: Threads = "current",
) -> Iterator[None]:
    """Replace the activations of sites by their dictionaries' reconstructions inside the ``with`` block.

    An :class:`~attribution.SAE` at a site reconstructs the site's value ``x`` (a module's output, or with
    ``site="input"`` its input); a :class:`~attribution.Transcoder` at a module (an MLP) predicts the module's output
    from its input (its first argument as called). With ``r = decode(features)`` the reconstruction of the features
    as they flow (patched or not) and ``r0`` that of the unpatched features:

    * ``error=True``: the site becomes ``x.detach() + (r - r0.detach())``, plus the change of the error term if
      that was patched: bitwise ``x`` while nothing is patched; the patched reconstruction plus the unpatched
      run's error ``x - r0`` when the features are patched; ``r0`` plus the patched error when the error is. The
      error is a constant for autograd, so gradients flow through the reconstruction, hence through the features
      (as TransformerLens's ``HookedSAETransformer`` does).
    * ``error=False``: the site becomes ``r`` (what the spliced loss measures); the error site holds zeros (patching
      it adds what is put there).

    Inside the block each dictionary is a site of the model: ``"<site>.dictionary.features"`` (``(...,
    n_features)``) and ``"<site>.dictionary.error"`` (``(..., d_out)``) are modules, attached for the block and
    removed on exit, so :func:`~attribution.record`, :func:`~attribution.patch` and the patching sweeps take them
    as ``layers`` with no code of their own. On exit (also when the body raises) the model is exactly as found: no
    child module, hook or attribute is left.

    Args:
        model: the model (a ``torch.compile`` d model: the module it wraps).
        dictionaries: site name (a module name, glob or module) -> dictionary.
        error: keep the error term (``True``) or replace the site by the reconstruction (``False``).
        site: an SAE reads and replaces the ``"output"`` of the module (default) or its ``"input"``; a transcoder
            always reads the input and replaces the output.
        element: for tuple, mapping or ``ModelOutput`` outputs, the tensor that is the site (an index or a name); for
            ``site="input"`` the argument (as in :func:`~attribution.patch`).
        threads: ``"current"`` splices the forwards of this thread only, ``"all"`` those of every thread.

    Raises:
        TypeError: a value that is not a dictionary; a site that is not a floating-point tensor (a tuple needs
            ``element``).
        ValueError: a site whose width differs from the dictionary's (both named), a module that already has a
            child or attribute ``dictionary`` (two splices of one module), ``site="input"`` for a transcoder.
        KeyError: an unknown module name (with the closest names).

    Example:
        >>> from attribution import SAE, record
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> x = torch.randn(3, 4)
        >>> with splice(model, {"0": SAE(4, 16, k=2)}), record(model, "0.dictionary.features") as acts:
        ...     same = bool(torch.equal(model(x), model(x)))
        >>> acts["0.dictionary.features"].shape, hasattr(model[0], "dictionary")
        (torch.Size([3, 16]), False)
    """
    if site not in ("output", "input"):
        raise ValueError(f"`site` must be 'output' or 'input'; got {site!r}")
    if threads not in ("current", "all"):
        raise ValueError(f"`threads` must be 'current' or 'all'; got {threads!r}")
    if not isinstance(error, bool):
        raise TypeError(f"`error` must be True or False; got {error!r}")
    model = eager_module(model)
    chosen = _chosen(model, dictionaries, site)
    attached: list[nn.Module] = []
    try:
        with ExitStack() as stack:
            for name, module, dictionary in chosen:
                module.add_module(CHILD, Spliced(dictionary, name, error=error))
                attached.append(module)
            stack.enter_context(eager_if_compiled(model))
            group = stack.enter_context(HookManager(model)).group("splice", threads=threads)
            _register(group, chosen, site, element)
            yield
    finally:
        for module in reversed(attached):
            del module._modules[CHILD]


def _chosen(
    model: nn.Module, dictionaries: Mapping[str, Dictionary], site: str
) -> list[tuple[str, nn.Module, Dictionary]]:
    """``(name, module, dictionary)`` for every key, checked before anything is attached."""
    if not isinstance(dictionaries, Mapping) or not dictionaries:
        raise TypeError("`dictionaries` must be a non-empty mapping {site name: SAE or Transcoder}")
    chosen: list[tuple[str, nn.Module, Dictionary]] = []
    for key, dictionary in dictionaries.items():
        if not isinstance(dictionary, (SAE, Transcoder)):
            raise TypeError(
                f"`dictionaries`[{key!r}] must be an SAE or a Transcoder; got {type(dictionary).__name__} (load one "
                "with attribution.load_dictionary)"
            )
        if isinstance(dictionary, Transcoder) and site != "output":
            raise ValueError("a Transcoder reads its module's input and replaces its output: leave site='output'")
        for name, module in resolve(model, key, what="`dictionaries` key"):
            if CHILD in module._modules or hasattr(module, CHILD):
                raise ValueError(
                    f"{name or 'the model'!r} already has a {CHILD!r} (a dictionary spliced there, or an attribute "
                    "of that name): splice one dictionary per site, in one call"
                )
            chosen.append((name, module, dictionary))
    return chosen


def _register(group: Any, chosen: list[tuple[str, nn.Module, Dictionary]], site: Any, element: Element) -> None:
    """The group's hooks: SAEs through the kernel's site hook; transcoders read the input, replace the output."""
    holders = {name: module.get_submodule(CHILD) for name, module, _ in chosen}
    saes = [name for name, _, d in chosen if isinstance(d, SAE)]
    transcoders = [name for name, _, d in chosen if isinstance(d, Transcoder)]
    if saes:
        hook_site(group, saes, site, element, lambda x, name, call: holders[name](x, x))
    if transcoders:

        def transcode(module: nn.Module, args: Any, kwargs: Any, output: Any, *, name: str) -> Any:
            source = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(source, torch.Tensor):
                raise SiteTypeError(
                    f"{name!r} was called without a tensor as its first argument: a Transcoder reads the module's input"
                )
            x = select(output, element, f"the output of {name!r}")
            return put(output, element, holders[name](x, source))

        group.forward(transcoders, transcode, with_kwargs=True)
