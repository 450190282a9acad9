"""Interchange interventions: run the base with each site's value mixed in from its source run (patching kernel)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from .._paired import check_same_shapes, plain
from .._run import eager_module, kept_state
from ..patching.sites import Patch, patch, record
from .site import Resolved, Site, gather, resolve_site, scatter

Interventions = Mapping[Site, nn.Module]


def interchange(model: nn.Module, base: Any, sources: Any, interventions: Interventions) -> Any:
    """The model's output on ``base`` with each site's intervention mixing in that site's ``sources`` run.

    Each source input runs once, without autograd, and its sites are recorded (``record``); the base then runs once
    with every site patched (``patch``) by ``intervention(base_part, source_part)``, where a part is the site's
    activation at its positions (and heads). Runs in eval mode without autograd; the model is left as found.

    Args:
        model: the model.
        base: the base input (a tensor, or a tuple/dict of model inputs).
        sources: one source input for every site, or a dict ``{Site: input}``; shaped like ``base``.
        interventions: ``{Site: intervention}``; an intervention is any module ``f(base, source) -> tensor``
            (:class:`Interchange`, :class:`RotatedSubspace`, ...).

    Returns:
        The model's output on the intervened base.

    Raises:
        ValueError: a site matching no module or several, sources shaped unlike the base, a width the intervention
            was not built for.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> from attribution.causal import Interchange
        >>> out = interchange(model, torch.zeros(1, 2), torch.ones(1, 2), {Site("0"): Interchange()})
        >>> torch.equal(out, model(torch.ones(1, 2)))
        True
    """
    model = eager_module(model)
    with kept_state(model), torch.no_grad():
        resolved = [resolve_site(model, site) for site in check_interventions(interventions)]
        recorded = record_sources(model, base, sources, resolved)
        with intervening(model, resolved, recorded, interventions):
            return model(**base) if isinstance(base, Mapping) else model(base)


def check_interventions(interventions: Any) -> list[Site]:
    """The sites of ``interventions``, after checking it is a non-empty ``{Site: module}`` mapping."""
    if not isinstance(interventions, Mapping) or not interventions:
        raise TypeError(f"`interventions` must be a non-empty dict {{Site: intervention}}; got {interventions!r}")
    for site, intervention in interventions.items():
        if not callable(intervention):
            raise TypeError(f"the intervention at {site!r} must be a module f(base, source); got {intervention!r}")
    return list(interventions)


def record_sources(model: nn.Module, base: Any, sources: Any, resolved: list[Resolved]) -> dict[Site, torch.Tensor]:
    """Each site's whole activation in its source run; each distinct source input runs once."""
    per_site = sources_by_site(sources)
    if per_site is not None and set(per_site) != {r.site for r in resolved}:
        missing = [r.site for r in resolved if r.site not in per_site]
        raise KeyError(f"`sources` is a dict by Site but has no input for {missing}; give one for every site")
    groups: dict[int, tuple[Any, list[Resolved]]] = {}
    for r in resolved:
        source = per_site[r.site] if per_site is not None else sources
        groups.setdefault(id(source), (source, []))[1].append(r)
    found: dict[Site, torch.Tensor] = {}
    for source, sites in groups.values():
        check_source_shapes(model, base, source, [r.site for r in sites])
        with ExitStack() as stack:
            acts = [
                (r, stack.enter_context(record(model, r.name, site=r.site.site, element=r.site.element))) for r in sites
            ]
            with torch.no_grad():
                model(**source) if isinstance(source, Mapping) else model(source)
        found.update({r.site: recorded[r.name] for r, recorded in acts})
    return found


def sources_by_site(sources: Any) -> Mapping[Site, Any] | None:
    """``sources`` when it is a dict ``{Site: input}``, else None (one input for all sites)."""
    if not isinstance(sources, Mapping) or not any(isinstance(k, Site) for k in sources):
        return None
    other = [k for k in sources if not isinstance(k, Site)]
    if other:
        raise TypeError(
            f"`sources` mixes Site keys with {other!r}: give either a dict {{Site: input}} (every key a Site) "
            "or one input for all sites"
        )
    return sources


def check_source_shapes(model: nn.Module, base: Any, source: Any, sites: list[Site]) -> None:
    """Raise, naming the sites and both shapes, unless ``source`` is shaped like ``base``."""
    try:
        check_same_shapes(plain(base, model), plain(source, model), ("`base`", "`sources`"))
    except ValueError as error:
        raise ValueError(
            f"the source for {', '.join(map(repr, sites))}: {error}; give sources shaped like the base"
        ) from None


@contextmanager
def intervening(
    model: nn.Module, resolved: list[Resolved], recorded: Mapping[Site, torch.Tensor], interventions: Interventions
) -> Iterator[None]:
    """Inside the block, each resolved site's activation is replaced by its intervention's output (a patch)."""
    with ExitStack() as stack:
        for r in resolved:
            stack.enter_context(
                patch(
                    model,
                    {r.name: Patch(mixer(r, recorded[r.site], interventions[r.site]), element=r.site.element)},
                    site=r.site.site,
                )
            )
        yield


def mixer(r: Resolved, source: torch.Tensor, intervention: nn.Module) -> Any:
    """The patch function of one site: gather the base's and the source's parts, intervene, scatter back."""
    site = r.site

    def mix(current: torch.Tensor) -> torch.Tensor:
        if current.shape != source.shape:
            raise ValueError(
                f"at {r.name!r} the base's activation is {tuple(current.shape)} but the source's is "
                f"{tuple(source.shape)}: give sources shaped like the base"
            )
        part = gather(current, site.positions, site.heads, r.n_heads)
        new = intervention(part, gather(source, site.positions, site.heads, r.n_heads).to(current.dtype))
        return scatter(current, new, site.positions, site.heads, r.n_heads)

    return mix
