"""What one batch adds to a report: the first pass and the second (band samples, once the bands are known).

The first pass keeps top examples, counts, extremes, moments, the quantile sketch and non-activating samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _examples, _math
from ._examples import Candidates, Slots

NAN_PLACES = 10


@dataclass
class Batch:
    """One batch of documents as the pass sees it."""

    acts: torch.Tensor
    """``(units, documents, tokens)`` float32, the units' activations."""
    ids: torch.Tensor
    """``(documents, tokens)`` token ids."""
    included: torch.Tensor
    """``(documents, tokens)`` bool: the positions that count (not BOS/pad/EOS, not excluded)."""
    first_document: int
    index: int
    """The batch's number in the whole run (the moments' merge tree is keyed by it)."""

    @property
    def documents(self) -> torch.Tensor:
        """``(documents,)`` the documents' numbers in the whole run."""
        return torch.arange(self.first_document, self.first_document + self.ids.shape[0])


def top_candidates(batch: Batch, slots: Slots, masked: torch.Tensor, k: int, gap: int) -> Candidates:
    """Each unit's peaks in this batch that can enter its top ``k`` (all ties with the k-th kept).

    ``masked``: the batch's activations with the positions that do not count at ``-inf``.
    """
    floor = torch.where(slots.full, slots.value[:, -1], _math.NEG)
    values, positions = _math.peaks(masked, k, gap, floor)  # (units, documents, k)
    units, docs, _ = values.shape
    flat = values.reshape(units, docs * k)
    kth = flat.topk(min(k, flat.shape[1]), dim=1).values[:, -1]
    take = (flat >= kth[:, None]) & (flat > floor[:, None])  # ties within the batch are ordered by the merge
    unit, index = take.nonzero(as_tuple=True)
    row = index // k
    return Candidates(
        group=unit,
        unit=unit,
        row=row,
        value=flat[unit, index],
        key=torch.zeros_like(unit),
        document=batch.documents[row],
        position=positions.reshape(units, docs * k)[unit, index],
    )


def quiet_candidates(batch: Batch, slots: Slots, eligible: torch.Tensor, seed: int) -> Candidates:
    """The eligible places of each unit with the smallest sampling keys (all ties with the last kept).

    Args:
        batch: the batch.
        slots: the samples so far of each unit.
        eligible: ``(units, documents, tokens)`` bool.
        seed: the keys' seed (:func:`_math.keys`).
    """
    units, _, tokens = batch.acts.shape
    place = _math.place_keys(seed, batch.documents, torch.arange(tokens)).reshape(-1)
    offsets = _math.unit_offsets(seed, torch.arange(units))
    ceiling = torch.where(slots.full, slots.key[:, -1], 2**62)
    unit, index, key = _math.smallest_keys(place, offsets, eligible.reshape(units, -1), ceiling, slots.value.shape[1])
    row, position = index // tokens, index % tokens
    return Candidates(
        group=unit,
        unit=unit,
        row=row,
        value=batch.acts[unit, row, position],
        key=key,
        document=batch.documents[row],
        position=position,
    )


def batch_context(batch: Batch, new: Candidates, left: int, like: Slots) -> _examples.Context:
    """The contexts of chosen candidates, read from the batch."""
    width = like.tokens.shape[-1]
    pair = (batch.acts, batch.ids)
    return lambda i: _examples.contexts(pair, new.unit[i], new.row[i], new.position[i], left, width)


@dataclass
class FirstPass:
    """The first pass's state: top examples, counts, extremes, moment blocks, the sketch, non-activating samples."""

    top: Slots
    quiet: Slots
    count: torch.Tensor
    nonzero: torch.Tensor
    nans: torch.Tensor
    max: torch.Tensor
    min: torch.Tensor
    sketch: torch.Tensor
    blocks: list[tuple[int, int, torch.Tensor]]
    nan_at: list[tuple[int, int, int]]
    """The first NaN activations: ``(document, position, unit)``, at most :data:`NAN_PLACES`."""
    gram: torch.Tensor | None = None
    """``(m, m)`` int64: sums of products of the activations of the co-activation units in steps of ``2^-QUANTUM``."""
    sums: torch.Tensor | None = None
    """``(m,)`` int64: sums of their activations in the same steps."""
    paired: torch.Tensor | None = None
    """``(m,)`` the co-activation units' numbers."""

    @classmethod
    def empty(cls, units: int, k: int, samples: int, width: int, *, paired: torch.Tensor | None = None) -> FirstPass:
        """Nothing seen yet; ``paired``: the units whose co-activation sums are kept."""
        m = 0 if paired is None else len(paired)
        zeros = torch.zeros(units, dtype=torch.long)
        return cls(
            top=Slots.empty(units, k, width),
            quiet=Slots.empty(units, samples, width),
            count=zeros.clone(),
            nonzero=zeros.clone(),
            nans=zeros.clone(),
            max=torch.full((units,), _math.NEG),
            min=torch.full((units,), float("inf")),
            sketch=torch.zeros((units, _math.BUCKETS), dtype=torch.long),
            blocks=[],
            nan_at=[],
            gram=None if paired is None else torch.zeros((m, m), dtype=torch.long),
            sums=None if paired is None else torch.zeros(m, dtype=torch.long),
            paired=paired,
        )

    def add(self, batch: Batch, *, k: int, gap: int, left: int, seed: int) -> None:
        """Take in one batch."""
        acts = batch.acts
        units = acts.shape[0]
        finite = ~torch.isnan(acts)
        valid = batch.included[None] & finite
        nan = batch.included[None] & ~finite
        self.nans += nan.sum((1, 2))
        if len(self.nan_at) < NAN_PLACES and bool(nan.any()):
            unit, row, position = nan.nonzero(as_tuple=True)
            found = zip(batch.documents[row].tolist(), position.tolist(), unit.tolist(), strict=True)
            self.nan_at = sorted([*self.nan_at, *found])[:NAN_PLACES]
        masked = torch.where(valid, acts, _math.NEG)
        top = top_candidates(batch, self.top, masked, k, gap)
        self.top = _examples.merge(self.top, top, "value", batch_context(batch, top, left, self.top))
        quiet = quiet_candidates(batch, self.quiet, valid & (acts <= 0), seed)
        self.quiet = _examples.merge(self.quiet, quiet, "key", batch_context(batch, quiet, left, self.quiet))
        count = valid.sum((1, 2))
        unit, place = (valid & (acts != 0)).reshape(units, -1).nonzero(as_tuple=True)
        value = acts.reshape(units, -1)[unit, place]
        nonzero = torch.bincount(unit, minlength=units)
        self.count += count
        self.nonzero += nonzero
        self.max = torch.maximum(self.max, masked.amax((1, 2)))
        self.min = torch.minimum(self.min, torch.where(valid, acts, float("inf")).amin((1, 2)))
        self.sketch += _math.sketch_counts(unit, value, count - nonzero)
        self.blocks = _math.fold_blocks([*self.blocks, (batch.index, 1, _math.entry_moments(unit, value, count))])
        if self.gram is not None and self.sums is not None and self.paired is not None:
            self._coactivation(acts, valid, unit, place, value)

    def _coactivation(
        self, acts: torch.Tensor, valid: torch.Tensor, unit: torch.Tensor, place: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Add this batch's co-activation sums of the paired units: from the non-zero entries, or dense."""
        assert self.paired is not None
        assert self.gram is not None
        assert self.sums is not None
        row = torch.full((acts.shape[0],), -1, dtype=torch.long)
        row[self.paired] = torch.arange(len(self.paired))
        mine = row[unit] >= 0
        sparse = _math.entry_coactivation(row[unit][mine], place[mine], value[mine], len(self.paired))
        if sparse is not None:
            index, product, sums = sparse
            self.gram.view(-1).index_add_(0, index, product)
        else:
            gram, sums = _math.coactivation(torch.where(valid, acts, 0.0)[self.paired].reshape(len(self.paired), -1))
            self.gram += gram
        self.sums += sums

    def merge(self, other: FirstPass) -> FirstPass:
        """Two disjoint parts of one run as one (the same bits as one process, whatever the split)."""
        return FirstPass(
            top=_examples.merge_slots(self.top, other.top, "value"),
            quiet=_examples.merge_slots(self.quiet, other.quiet, "key"),
            count=self.count + other.count,
            nonzero=self.nonzero + other.nonzero,
            nans=self.nans + other.nans,
            max=torch.maximum(self.max, other.max),
            min=torch.minimum(self.min, other.min),
            sketch=self.sketch + other.sketch,
            blocks=_math.fold_blocks(self.blocks + other.blocks),
            nan_at=sorted(self.nan_at + other.nan_at)[:NAN_PLACES],
            gram=None if self.gram is None or other.gram is None else self.gram + other.gram,
            sums=None if self.sums is None or other.sums is None else self.sums + other.sums,
            paired=self.paired,
        )


@dataclass
class Bands:
    """The second pass's state: uniform samples within each unit's bands of activating (positive) values.

    ``"interval"``: ``bands`` equal-width intervals of ``(0, max]``; ``"rank"``: ``bands`` equal-count bins of the
    positive values, cut at the sketch's quantiles. Group ``unit * bands + j`` is band ``j`` of ``unit``.
    """

    interval: Slots
    rank: Slots
    edges: dict[str, torch.Tensor]
    """``(units, bands + 1)`` float64 band edges of each kind (band ``j`` is ``(edges[j], edges[j + 1]]``)."""

    @classmethod
    def empty(cls, first: FirstPass, bands: int, samples: int, width: int) -> Bands:
        """No samples yet; the bands cut from the first pass's maxima and sketch."""
        units = first.count.shape[0]
        top = first.max.double().clamp(min=0)
        interval = top[:, None] * torch.arange(bands + 1, dtype=torch.float64)[None, :] / bands
        positive = first.sketch.clone()
        positive[:, : _math.SIDE + 1] = 0
        inner = _math.sketch_quantile(positive, torch.arange(1, bands, dtype=torch.float64) / bands)
        inner = torch.minimum(inner.nan_to_num(0.0), top[:, None])  # a bucket's value can pass the maximum by 2%
        rank = torch.cat([torch.zeros(units, 1, dtype=torch.float64), inner, top[:, None]], dim=1)
        return cls(
            interval=Slots.empty(units * bands, samples, width),
            rank=Slots.empty(units * bands, samples, width),
            edges={"interval": interval, "rank": rank},
        )

    def add(self, batch: Batch, *, seed: int, left: int) -> None:
        """Take in one batch: its positive values only, each in its band's group, the smallest keys first."""
        unit, row, position = (batch.included[None] & (batch.acts > 0)).nonzero(as_tuple=True)
        value = batch.acts[unit, row, position]
        document = batch.documents[row]
        key = _math.keys_at(seed + 1, unit, document, position)
        bands = self.edges["interval"].shape[1] - 1
        for kind in ("interval", "rank"):
            slots = getattr(self, kind)
            inner = self.edges[kind][:, 1:-1]
            band = torch.cat([(v.double()[:, None] > inner[u]).sum(1) for v, u in
                              zip(value.split(2**18), unit.split(2**18), strict=True)])  # fmt: skip
            group = unit * bands + band
            open_ = key <= torch.where(slots.full, slots.key[:, -1], 2**62)[group]  # could still enter its group
            g, k, d, p = group[open_], key[open_], document[open_], position[open_]
            order = _math.lexsort(p, d, k, g)
            order = order[_math.group_rank(g[order]) < slots.value.shape[1]]
            picked = open_.nonzero().flatten()[order]
            new = Candidates(group=group[picked], unit=unit[picked], row=row[picked], value=value[picked],
                             key=key[picked], document=document[picked], position=position[picked])  # fmt: skip
            setattr(self, kind, _examples.merge(slots, new, "key", batch_context(batch, new, left, slots)))

    def merge(self, other: Bands) -> Bands:
        """Two disjoint parts of one second pass as one."""
        return Bands(
            interval=_examples.merge_slots(self.interval, other.interval, "key"),
            rank=_examples.merge_slots(self.rank, other.rank, "key"),
            edges=self.edges,
        )
