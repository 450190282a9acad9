"""A sweep of trained interventions over sites and subspace sizes: held-out IIA as a labelled table, and its plot."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._progress import progress as progress_bar
from .._run import eager_module, kept_state
from ..patching.result import PatchingResult
from ._data import Batches, prepare
from .interchange import check_source_shapes
from .interventions import Interchange, RotatedSubspace
from .site import Resolved, Site, gather, resolve_site
from .train import SCORING_BATCH, Schedule, accuracy, check_labels, fit, freeze

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Triples = tuple[Any, Any, torch.Tensor]
"""``(base, sources, labels)``: base inputs, source inputs shaped like them, the counterfactual labels."""

MakeIntervention = Callable[[int, int], nn.Module]


@dataclass
class InterventionSweep:
    """The result of :func:`intervention_sweep`.

    Attributes:
        iia: held-out IIA, a :class:`~attribution.patching.PatchingResult` with axes ``("site", "k")``, labelled with
            the sites' labels and the subspace sizes.
        interventions: the trained interventions, ``{(site label, k): module}``.
    """

    iia: PatchingResult
    interventions: dict[tuple[str, int | str], nn.Module] = field(repr=False)

    def best(self) -> tuple[str, int | str, float]:
        """``(site label, k, IIA)`` of the highest held-out IIA (the first one on a tie)."""
        values = self.iia.as_subclass(torch.Tensor)
        i, j = divmod(int(values.flatten().argmax()), values.shape[1])
        return self.iia.labels["site"][i], self.iia.labels["k"][j], float(values[i, j])

    def plot(self, ax: Axes | None = None, title: str | None = "held-out IIA", **kwargs: Any) -> Axes:
        """A heatmap of the IIA (sites down, ``k`` across), a sequential colour map from 0 to 1, values written."""
        from ..plot.patching import plot_patching

        options = {"cmap": "viridis", "limits": (0.0, 1.0), "annotate": True, **kwargs}
        return plot_patching(self.iia, ax=ax, title=title, **options)


def intervention_sweep(
    model: nn.Module,
    train: Triples,
    test: Triples,
    sites: Sequence[Site] | Mapping[str, Site],
    ks: Sequence[int | str] = (1,),
    *,
    intervention: MakeIntervention | None = None,
    progress: bool = True,
    **training: Any,
) -> InterventionSweep:
    """Train an intervention at every site and subspace size on ``train``; measure its IIA on ``test``.

    For each site and each ``k``, ``intervention(width, k)`` (default :class:`RotatedSubspace`, i.e. DAS) is built
    for the site's width (the intervened part's last axis: positions and heads as the :class:`Site` selects),
    trained as :func:`train_intervention` trains it, with ``training``'s settings, and scored as
    :func:`interchange_intervention_accuracy` scores it on the held-out ``test`` triples. Two sizes need no
    training: ``k = 0`` swaps nothing (the base run's agreement with the counterfactual labels, the floor) and
    ``k = "all"`` swaps the whole part (plain activation patching, :class:`Interchange`). The sources run once for
    all sites, and on a causal language model the base's prefix before a site's first position runs once per
    distinct first position; every cell reuses them.

    Args:
        model: the model (left as found).
        train: ``(base, sources, labels)`` to train on.
        test: ``(base, sources, labels)`` to score on (held out).
        sites: the sites, labelled by their module names and positions, or a dict ``{label: Site}``.
        ks: the subspace sizes: ints ``>= 0`` and ``"all"``.
        intervention: ``(width, k) -> module``; default :class:`RotatedSubspace`.
        progress: a progress bar over the cells.
        **training: keyword arguments of :func:`train_intervention`: ``epochs``, ``lr``, ``batch_size``, ``seed``,
            ``loss``.

    Returns:
        An :class:`InterventionSweep`: ``.iia`` ``(sites, ks)``, ``.interventions``, ``.best()``, ``.plot()``.

    Raises:
        ValueError: a ``k`` wider than a site, an empty or duplicated site list, triples of the wrong shape.
    """
    labelled = check_sweep(sites, ks, train, test, training)
    model = eager_module(model)
    resolved = [resolve_site(model, site) for _, site in labelled]
    for triple in (train, test):
        check_source_shapes(model, triple[0], triple[1], [r.site for r in resolved])
    schedule = Schedule(**{key: value for key, value in training.items() if key != "loss"})
    values = torch.zeros(len(labelled), len(ks), dtype=torch.float64)
    trained: dict[tuple[str, int | str], nn.Module] = {}
    with kept_state(model):
        freeze(model)
        fitting = prepare(model, *train, resolved, schedule.batch_size)
        with torch.no_grad():
            scoring = prepare(model, *test, resolved, SCORING_BATCH)
        cells = [(i, j) for i in range(len(labelled)) for j in range(len(ks))]
        for i, j in progress_bar(cells, desc="intervention sweep", enabled=progress, unit="cell"):
            r, k = resolved[i], ks[j]
            module = cell_intervention(model, fitting[r], k, intervention, schedule, training.get("loss"))
            seen, data = scoring[r]
            values[i, j] = accuracy(model, seen, module, data)
            trained[labelled[i][0], k] = module
    result = PatchingResult(values, {"site": [label for label, _ in labelled], "k": list(ks)})
    return InterventionSweep(result, trained)


def cell_intervention(
    model: nn.Module,
    prepared: tuple[Resolved, Batches],
    k: int | str,
    make: MakeIntervention | None,
    schedule: Schedule,
    loss: Any,
) -> nn.Module:
    """The intervention of one cell: the identity for ``k = 0``, the swap for ``"all"``, else one trained."""
    r, data = prepared
    width = int(gather(data.source_acts[:1], r.site.positions, r.site.heads, r.n_heads).shape[-1])
    if k == 0:
        return Keep()
    if k == "all" or k == width:
        return Interchange()
    module = (make or RotatedSubspace)(width, int(k)).to(data.source_acts.dtype)
    fit(model, r, module, data, schedule, loss)
    return module


class Keep(nn.Module):
    """The base's own value (nothing swapped): the floor of a sweep."""

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``base``."""
        return base


def check_sweep(
    sites: Sequence[Site] | Mapping[str, Site], ks: Sequence[int | str], train: Triples, test: Triples, training: Any
) -> list[tuple[str, Site]]:
    """The sites with their labels, after checking the sweep's arguments."""
    for name, triple in (("train", train), ("test", test)):
        if not isinstance(triple, tuple | list) or len(triple) != 3:
            raise TypeError(f"`{name}` must be a tuple (base, sources, labels); got {type(triple).__name__}")
        check_labels(triple[0], triple[2])
    if not ks or any(k != "all" and (not isinstance(k, int) or k < 0) for k in ks):
        raise ValueError(f"`ks` must be a non-empty sequence of ints >= 0 or 'all' (subspace sizes); got {list(ks)!r}")
    unknown = set(training) - {"epochs", "lr", "batch_size", "seed", "loss"}
    if unknown:
        raise TypeError(f"unknown training settings {sorted(unknown)}: give epochs, lr, batch_size, seed or loss")
    pairs = list(sites.items()) if isinstance(sites, Mapping) else [(site_label(s), s) for s in sites]
    if not pairs:
        raise ValueError("`sites` is empty: give at least one Site")
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two sites have the same label in {labels}: pass a dict {{label: Site}}")
    return pairs


def site_label(site: Site) -> str:
    """A short label: the module's name, then its positions and heads where the site picks them."""
    if not isinstance(site, Site):
        raise TypeError(f"`sites` must hold Site objects (e.g. Site('model.layers.1')); got {site!r}")
    label = site.module if isinstance(site.module, str) else type(site.module).__name__
    if site.site == "input":
        label += ".input"
    if site.positions is not None:
        label += " @" + ",".join(map(str, site.positions))
    if site.heads is not None:
        label += " H" + ",".join(map(str, site.heads))
    return label
