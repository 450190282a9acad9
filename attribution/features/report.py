"""What a pass over a dataset found about each unit: :class:`UnitReport`, its examples, statistics and effects."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .._inputs import decoder
from . import _math
from ._accumulate import Bands, FirstPass
from ._examples import Slots

FORMAT = "hookscope.UnitReport/1"


@dataclass(frozen=True)
class Example:
    """One position of one document where a unit was read, with its context.

    ``tokens`` and ``activations`` run from up to ``left`` positions before the example to ``right`` after it
    (cut at the document's ends); the example itself is ``tokens[offset]``.
    """

    document: int
    position: int
    value: float
    tokens: tuple[int, ...] = ()
    activations: tuple[float, ...] = ()
    offset: int = 0


Unit = int | str


@dataclass
class UnitReport:
    """Examples, statistics and effects of units over a dataset (made by :func:`feature_statistics`).

    Statistics are over every included token (BOS/pad/EOS and excluded positions left out); units are numbered
    ``0..n-1`` in the order given, and methods take that number or the unit's label (``"L3/N17"``, ``"F12"``, ``"D0"``).
    """

    labels: list[str]
    settings: dict[str, Any]
    first: FirstPass
    band_samples: Bands | None = None
    writes: torch.Tensor | None = None
    """``(units, d_model)`` what each unit writes into the residual stream (``None`` where unknown)."""
    logits: dict[str, torch.Tensor] | None = None
    """``top_ids``/``top_values``/``bottom_ids``/``bottom_values``, ``(units, 20)``: the logit effects."""
    documents: int = 0
    tokenizer: Any = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    """One entry per kind of unit given, in order, with ``kind``, ``module``, ``side``, ``layer`` and ``indices``.

    See :meth:`find`.
    """

    # -- look-ups ---------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.labels)

    def find(self, kind: str, layer: int | None, index: int, module: str | None = None) -> int | None:
        """The number of the unit that is neuron/head/feature/direction ``index`` of ``layer`` (or of ``module``).

        ``kind`` is ``"neuron"``, ``"head"``, ``"feature"`` or ``"direction"``; ``None`` where the report has no such
        unit.
        """
        first = 0
        for source in self.sources:
            indices = source["indices"]
            same_place = source["layer"] == layer if module is None else source["module"] == module
            if source["kind"] == kind and same_place and index in indices:
                return first + indices.index(index)
            first += len(indices)
        return None

    def index(self, unit: Unit) -> int:
        """A unit's number from its number or label."""
        if isinstance(unit, str):
            if unit not in self.labels:
                raise KeyError(f"no unit is labelled {unit!r}; labels run {self.labels[:3]}... ({len(self)} units)")
            return self.labels.index(unit)
        if not isinstance(unit, int) or not -len(self) <= unit < len(self):
            raise IndexError(f"`unit` must be a number in [0, {len(self)}) or a label; got {unit!r}")
        return unit % len(self)

    def _examples(self, slots: Slots, row: int) -> list[Example]:
        left = int(self.settings["context"][0])
        documents, positions = slots.document[row].tolist(), slots.position[row].tolist()
        values, tokens, acts = slots.value[row].tolist(), slots.tokens[row].tolist(), slots.acts[row].tolist()
        out = []
        for s, document in enumerate(documents):  # plain lists: a unit's examples are read thousands of times
            if document < 0:
                break
            inside = [i >= 0 for i in tokens[s]]
            out.append(
                Example(
                    document=document,
                    position=positions[s],
                    value=values[s],
                    tokens=tuple(t for t, keep in zip(tokens[s], inside, strict=True) if keep),
                    activations=tuple(a for a, keep in zip(acts[s], inside, strict=True) if keep),
                    offset=left - inside[:left].count(False),
                )
            )
        return out

    def top(self, unit: Unit) -> list[Example]:
        """The unit's top examples: value descending, ties by document then position, one per document window."""
        return self._examples(self.first.top, self.index(unit))

    def non_activating(self, unit: Unit) -> list[Example]:
        """A uniform sample of the positions where the unit is at most 0 (for contrast and for detection scoring)."""
        return self._examples(self.first.quiet, self.index(unit))

    def bands(self, unit: Unit, kind: Literal["interval", "rank"] = "interval") -> list[list[Example]]:
        """Uniform samples of the unit's activating (positive) values, band by band from the lowest.

        ``"interval"``: equal-width intervals of ``(0, max]`` (Anthropic, sae_vis); ``"rank"``: equal-count bins of
        the positive values (delphi), cut at the sketch's quantiles. See :meth:`band_edges`.
        """
        if self.band_samples is None:
            raise ValueError("this report has no band samples: run feature_statistics with bands > 0")
        if kind not in ("interval", "rank"):
            raise ValueError(f"`kind` must be 'interval' or 'rank'; got {kind!r}")
        bands = int(self.settings["bands"])
        slots = getattr(self.band_samples, kind)
        i = self.index(unit)
        return [self._examples(slots, i * bands + j) for j in range(bands)]

    def band_edges(self, unit: Unit, kind: Literal["interval", "rank"] = "interval") -> list[float]:
        """The ``bands + 1`` edges: band ``j`` holds the values in ``(edges[j], edges[j + 1]]``."""
        if self.band_samples is None:
            raise ValueError("this report has no band samples: run feature_statistics with bands > 0")
        return self.band_samples.edges[kind][self.index(unit)].tolist()

    # -- statistics -------------------------------------------------------------------------------------------------
    @property
    def count(self) -> torch.Tensor:
        """``(units,)`` how many values each unit's statistics are over."""
        return self.first.count.clone()

    @property
    def density(self) -> torch.Tensor:
        """``(units,)`` float64: the fraction of values that are not zero."""
        return self.first.nonzero.double() / self.first.count.clamp(min=1)

    @property
    def max(self) -> torch.Tensor:
        """``(units,)`` the largest value (``-inf`` for a unit that saw none)."""
        return self.first.max.clone()

    @property
    def min(self) -> torch.Tensor:
        """``(units,)`` the smallest value."""
        return self.first.min.clone()

    def _moments(self) -> dict[str, torch.Tensor]:
        return _math.describe_moments(_math.total_moments(self.first.blocks, len(self)))

    @property
    def mean(self) -> torch.Tensor:
        """``(units,)`` float64."""
        return self._moments()["mean"]

    @property
    def variance(self) -> torch.Tensor:
        """``(units,)`` float64, the population variance (divided by the count)."""
        return self._moments()["variance"]

    @property
    def skewness(self) -> torch.Tensor:
        """``(units,)`` float64 (NaN for a constant unit)."""
        return self._moments()["skewness"]

    @property
    def kurtosis(self) -> torch.Tensor:
        """``(units,)`` float64, the excess kurtosis (0 for a normal distribution; NaN for a constant unit)."""
        return self._moments()["kurtosis"]

    @property
    def nans(self) -> torch.Tensor:
        """``(units,)`` how many included positions gave NaN (left out of every statistic)."""
        return self.first.nans.clone()

    @property
    def nan_at(self) -> list[tuple[int, int, int]]:
        """The first NaN values as ``(document, position, unit)``."""
        return list(self.first.nan_at)

    @property
    def dead(self) -> list[int]:
        """The units that were never non-zero."""
        return (self.first.nonzero == 0).nonzero().flatten().tolist()

    def quantile(self, q: float | torch.Tensor) -> torch.Tensor:
        """``(units,)`` (or ``(units, len(q))``) quantiles of all values, from the sketch.

        Each answer is within ``ALPHA`` (2%) of a value whose rank is off by less than :attr:`quantile_error`.
        """
        qs = torch.as_tensor(q, dtype=torch.float64).reshape(-1)
        if bool(((qs < 0) | (qs > 1)).any()):
            raise ValueError(f"`q` must lie in [0, 1]; got {qs.tolist()}")
        out = _math.sketch_quantile(self.first.sketch, qs)
        return out[:, 0] if torch.as_tensor(q).dim() == 0 else out

    @property
    def quantile_error(self) -> torch.Tensor:
        """``(units,)`` the bound on the rank error of :meth:`quantile` (a fraction of the count)."""
        return _math.rank_error(self.first.sketch)

    def histogram(self, unit: Unit, bins: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
        """``(edges (bins + 1,), counts (bins,))`` of the unit's non-zero values, equal-width from min to max.

        Read from the sketch: each sketch bucket's count goes to the bin of the value it stands for (within 2%).
        """
        i = self.index(unit)
        counts = self.first.sketch[i].clone()
        counts[_math.SIDE] = 0
        values = _math.bucket_values()
        low, high = float(self.first.min[i]), float(self.first.max[i])
        if not counts.any():
            return torch.linspace(0, 1, bins + 1, dtype=torch.float64), torch.zeros(bins, dtype=torch.long)
        edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
        where = ((values.clamp(low, high) - low) / max(high - low, 1e-300) * bins).long().clamp(0, bins - 1)
        return edges, torch.zeros(bins, dtype=torch.long).index_add_(0, where, counts)

    # -- effects ----------------------------------------------------------------------------------------------------
    def logit_effects(self, unit: Unit, k: int = 10) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """The tokens whose logits the unit's output direction raises most and lowers most, with the values.

        The direction goes through the final norm's gain (centred for LayerNorm, scale left out) and the unembedding,
        as the logit lens reads a residual direction.
        """
        if self.logits is None:
            raise ValueError(
                "this report has no logit effects: the units' output directions are not in the residual stream, or "
                "the model has no final norm and unembedding that attribution.models.lm_layout finds"
            )
        i = self.index(unit)
        stored = self.logits["top_ids"].shape[1]
        if k > stored:
            raise ValueError(f"`k` can be at most {stored} (the effects kept per unit); got {k}")
        top = list(zip(self.logits["top_ids"][i, :k].tolist(), self.logits["top_values"][i, :k].tolist(), strict=True))
        bottom = list(
            zip(self.logits["bottom_ids"][i, :k].tolist(), self.logits["bottom_values"][i, :k].tolist(), strict=True)
        )
        return top, bottom

    def neighbours(
        self, unit: Unit, k: int = 10, by: Literal["correlation", "cosine"] = "correlation"
    ) -> list[tuple[int, float]]:
        """The ``k`` other units most alike: by activation correlation over the whole dataset, or decoder cosine."""
        i = self.index(unit)
        if by == "cosine":
            if self.writes is None:
                raise ValueError("this report has no output directions to compare")
            w = torch.nn.functional.normalize(self.writes.double(), dim=1)
            row = w @ w[i]
        elif by == "correlation":
            first = self.first
            if first.gram is None or first.sums is None or first.paired is None:
                raise ValueError(
                    "this report has no co-activation sums: run feature_statistics with coactivation=True"
                )  # fmt: skip
            where = (first.paired == i).nonzero().flatten()
            if not len(where):
                raise ValueError(
                    f"unit {self.labels[i]!r} has no co-activation sums (they are kept for dictionary features, or "
                    "for every unit with coactivation=True): use by='cosine'"
                )
            values = _math.correlation(first.gram, first.sums, int(first.count[i]), where)[0]
            row = torch.full((len(self),), float("nan"), dtype=torch.float64)
            row[first.paired] = values
        else:
            raise ValueError(f"`by` must be 'correlation' or 'cosine'; got {by!r}")
        row = row.clone()
        row[i] = float("nan")
        order = torch.argsort(torch.nan_to_num(row, nan=-float("inf")), descending=True, stable=True)[:k]
        return [(int(j), float(row[j])) for j in order if not torch.isnan(row[j])]

    def text(self, ids: Any) -> str:
        """Token ids as text, through the report's tokenizer (``[id]`` without one)."""
        decode = decoder(self.tokenizer)
        return "".join(decode(int(t)) for t in ids)

    # -- the peers' files -------------------------------------------------------------------------------------------
    def to_circuit_tracer(self, folder: str | Path, **options: Any) -> list[Path]:
        """One circuit-tracer feature file per live unit (see :func:`attribution.features.export.to_circuit_tracer`)."""
        from .export import to_circuit_tracer

        return to_circuit_tracer(self, folder, **options)

    def to_neuronpedia(self, folder: str | Path, *, model_id: str, **options: Any) -> list[Path]:
        """Neuronpedia's feature and activation rows (see :func:`attribution.features.export.to_neuronpedia`)."""
        from .export import to_neuronpedia

        return to_neuronpedia(self, folder, model_id=model_id, **options)

    def neuron_record(self, unit: Unit) -> dict[str, Any]:
        """OpenAI automated-interpretability's ``NeuronRecord`` of a unit, as a dict.

        See :func:`attribution.features.export.neuron_record`.
        """
        from .export import neuron_record

        return neuron_record(self, unit)

    # -- merging and files ------------------------------------------------------------------------------------------
    def merge(self, other: UnitReport) -> UnitReport:
        """This report and one over other documents of the same run as one (shards of a torchrun run).

        The result is the report one process gives over both parts, bit for bit. Band samples merge only when both
        were cut at the same edges (the second pass of one run); otherwise they are dropped with the reason.
        """
        if not isinstance(other, UnitReport):
            raise TypeError(f"`other` must be a UnitReport; got {type(other).__name__}")
        for name in ("labels", "settings"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"the reports differ in their {name}: only parts of one run merge")
        covered = sorted((s, s + n) for s, n, _ in self.first.blocks + other.first.blocks)
        if any(a[1] > b[0] for a, b in itertools.pairwise(covered)):
            raise ValueError("the reports cover some of the same batches: only disjoint parts of one run merge")
        bands = None
        if self.band_samples is not None and other.band_samples is not None:
            same = all(
                torch.equal(self.band_samples.edges[k], other.band_samples.edges[k]) for k in ("interval", "rank")
            )
            if not same:
                raise ValueError(
                    "the reports' bands were cut at different edges (separate runs): merge their first passes with "
                    "bands=0, or run one feature_statistics under torchrun"
                )
            bands = self.band_samples.merge(other.band_samples)
        return UnitReport(
            labels=self.labels,
            settings=self.settings,
            first=self.first.merge(other.first),
            band_samples=bands,
            writes=self.writes,
            logits=self.logits,
            documents=self.documents + other.documents,
            tokenizer=self.tokenizer,
            sources=self.sources,
        )

    def state(self) -> dict[str, Any]:
        """Everything but the tokenizer, as plain tensors, lists and numbers."""
        first = self.first
        return {
            "format": FORMAT,
            "labels": list(self.labels),
            "settings": json.loads(json.dumps(self.settings)),
            "top": first.top.state(),
            "quiet": first.quiet.state(),
            "stats": {k: getattr(first, k) for k in ("count", "nonzero", "nans", "max", "min", "sketch")},
            "blocks": [(s, n, m) for s, n, m in first.blocks],
            "nan_at": [list(x) for x in first.nan_at],
            "gram": first.gram,
            "sums": first.sums,
            "paired": first.paired,
            "bands": None
            if self.band_samples is None
            else {
                "interval": self.band_samples.interval.state(),
                "rank": self.band_samples.rank.state(),
                "edges": dict(self.band_samples.edges),
            },
            "writes": self.writes,
            "logits": self.logits,
            "documents": self.documents,
            "sources": json.loads(json.dumps(self.sources)),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], tokenizer: Any = None) -> UnitReport:
        """The report of :meth:`state`."""
        if state.get("format") != FORMAT:
            raise ValueError(f"not a UnitReport (format {state.get('format')!r}, expected {FORMAT!r})")
        first = FirstPass(
            top=Slots(**state["top"]),
            quiet=Slots(**state["quiet"]),
            blocks=[(int(s), int(n), m) for s, n, m in state["blocks"]],
            nan_at=[(int(a), int(b), int(c)) for a, b, c in state["nan_at"]],
            gram=state["gram"],
            sums=state["sums"],
            paired=state.get("paired"),
            **state["stats"],
        )
        bands = state["bands"]
        return cls(
            labels=list(state["labels"]),
            settings=state["settings"],
            first=first,
            band_samples=None
            if bands is None
            else Bands(interval=Slots(**bands["interval"]), rank=Slots(**bands["rank"]), edges=bands["edges"]),
            writes=state["writes"],
            logits=state["logits"],
            documents=int(state["documents"]),
            tokenizer=tokenizer,
            sources=list(state.get("sources", [])),
        )

    def save(self, path: str | Path) -> Path:
        """Write the report to one file, atomically, with a digest that :meth:`load` checks."""
        return write_verified(Path(path), self.state())

    @classmethod
    def load(cls, path: str | Path, *, tokenizer: Any = None) -> UnitReport:
        """Read a report written by :meth:`save` (its digest checked); ``tokenizer`` turns ids into text."""
        return cls.from_state(read_verified(Path(path)), tokenizer)

    def __repr__(self) -> str:
        bands = self.settings.get("bands", 0)
        tokens = int(self.first.count.amax()) if len(self) else 0
        return (
            f"UnitReport({len(self)} units, {self.documents} documents, {tokens} tokens, "
            f"k={self.settings.get('k')}, bands={bands}, dead={len(self.dead)})"
        )


def write_verified(path: Path, state: dict[str, Any]) -> Path:
    """``state`` written to ``path`` atomically: a JSON header line with the body's SHA-256, then the body."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    body = buffer.getvalue()
    header = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.encode() + b"\n" + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_verified(path: Path) -> dict[str, Any]:
    """The state in a file of :func:`write_verified`; a damaged or foreign file is refused by name."""
    data = path.read_bytes()
    line, _, body = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        raise ValueError(f"{path} is not a file written by UnitReport.save (no header line)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a UnitReport file (header {str(header)[:80]!r})")
    if len(body) != header.get("bytes") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise ValueError(f"{path} is damaged: its contents do not match the digest written with them")
    state: dict[str, Any] = torch.load(io.BytesIO(body), weights_only=True)
    return state
