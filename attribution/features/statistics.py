"""One streamed pass over a dataset that reads what units do: :func:`feature_statistics`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import _distributed
from .._progress import progress as progress_bar
from .._run import HookedRun, eager_module, hook_site, warn
from . import _logits
from ._accumulate import Bands, Batch, FirstPass
from ._cache import SiteCache, Sites
from .report import UnitReport, read_verified, write_verified
from .units import Bound, Units, bind_all

CHECKPOINT_EVERY = 4
"""Batches between two checkpoints (and one at the end of each pass)."""


class _Stop(Exception):
    """Raised once every site has been read: the rest of the forward is not needed."""


@dataclass
class _Plan:
    """What the pass reads and how it cuts and counts."""

    bound: list[Bound]
    k: int
    left: int
    right: int
    gap: int
    bands: int
    samples: int
    seed: int
    special: list[int]
    exclude: list[int]


def feature_statistics(
    model: nn.Module,
    tokens: Any,
    units: Units | Sequence[Units],
    *,
    tokenizer: Any = None,
    k: int = 20,
    context: tuple[int, int] = (8, 4),
    bands: int = 10,
    samples: int = 5,
    min_gap: int | None = None,
    exclude: Sequence[int] | None = None,
    batch_size: int = 8,
    coactivation: bool | None = None,
    seed: int = 0,
    checkpoint: str | Path | None = None,
    cache: str | Path | None = None,
    progress: bool = True,
) -> UnitReport:
    """Read what units do over a whole dataset, streamed: top examples, statistics, bands, logit effects.

    One pass over the documents keeps, per unit, the exact top ``k`` examples (value descending, ties by document
    then position; two examples of one document at least ``min_gap`` positions apart), the count, density, extremes
    and moments (merged exactly, so any split of the data gives the same bits), a quantile sketch (every value within
    2% of a value whose rank error :attr:`UnitReport.quantile_error` bounds), a uniform sample of non-activating
    positions, and for dictionary features the co-activation sums. A second pass, once each unit's maximum and
    quantiles are known, samples ``samples`` examples uniformly within each of ``bands`` bands of activating values,
    both as equal-width intervals of ``(0, max]`` and as equal-count rank bins: exact bands, without the bias of a
    running maximum. Memory is ``O(units x (k + bands x samples) x context)``, whatever the number of tokens.

    Under ``torchrun`` each process takes a contiguous share of the batches and every process returns the merged
    report, bit for bit the one-process report. With ``checkpoint`` the state is written every
    four batches; the same call after a kill resumes there and gives the same report.

    Args:
        model: a language model taking token ids ``(batch, tokens)`` (left as found).
        tokens: documents of token ids: a ``(documents, tokens)`` tensor; a store of documents that slices into
            such rows (a memory-mapped NumPy array, an HF dataset with ``input_ids``), read ``batch_size`` documents
            at a time, so that only one batch is in memory; or a DataLoader (or other iterable) of such tensors or of
            dicts with ``input_ids`` (and ``attention_mask``).
        units: :class:`Neurons`, :class:`Features`, :class:`Directions`, or a list of them (numbered in turn).
        tokenizer: turns ids into text in dashboards and exports (kept in the report); its BOS/EOS/pad ids (else the
            model config's) are left out of every statistic.
        k: top examples per unit.
        context: positions shown before and after each example.
        bands: bands of activating values (0: no second pass).
        samples: examples sampled per band, and non-activating examples per unit.
        min_gap: least distance of two top examples of one document (``None``: the context's width; 0: none).
        exclude: positions (of every document; negative from the end) also left out.
        batch_size: documents per forward, for a tensor of documents.
        coactivation: keep the co-activation sums for neighbours by correlation (``None``: for dictionary features
            only, up to 8,192 units; a ``units x units`` int64 matrix).
        seed: the seed of the uniform samples.
        checkpoint: a file the state is written to, from which the same call resumes.
        cache: a folder where the first pass keeps the sites' tensors (one verified file per batch, in their dtype:
            ``tokens x width x 4`` bytes for a float32 site, 150 MB for 65,536 tokens of a 576-wide one) for the
            second pass to read instead of running the model again (about half the time with bands); the files are
            removed at the end. ``None``: the model runs twice.
        progress: show progress bars on a terminal.

    Returns:
        The :class:`UnitReport`.

    Raises:
        ValueError: bad settings, an empty dataset, a resumed run whose settings or data changed (named).
        TypeError: ``tokens`` or ``units`` of another kind.

    Example:
        >>> import transformers
        >>> from attribution.features import Neurons
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(1, 50, (6, 12)), Neurons(1), k=3, bands=2,
        ...     context=(2, 2))
        >>> len(report), len(report.top(0)), report.top(0)[0].value >= report.top(0)[1].value
        (32, 3, True)
    """
    model = eager_module(model)
    plan = _plan(model, units, tokenizer, k, context, bands, samples, min_gap, exclude, seed)
    width = sum(b.width for b in plan.bound)
    paired = _paired(coactivation, plan.bound)
    source = _Source(tokens, batch_size)
    settings = _settings(plan, model, source, paired)
    rank, world = _distributed.setup()
    mine = source.share(rank, world)
    path = None if checkpoint is None else Path(f"{checkpoint}.rank{rank}of{world}" if world > 1 else checkpoint)
    state = _Resume(path, settings)
    sites = None if cache is None else SiteCache(cache, settings, rank)
    first = state.first or FirstPass.empty(width, plan.k, plan.samples, plan.left + plan.right + 1, paired=paired)
    if state.phase == 1:
        for batch in _run(model, plan, source, mine, state, sites, "features: pass 1", progress):
            first.add(batch, k=plan.k, gap=plan.gap, left=plan.left, seed=plan.seed)
            state.passed(batch.index, first, None)
        state.save(first, None, phase=2, at=0)
    local, first = first, _merge_all(first)
    bands_state = None
    if plan.bands:
        bands_state = state.bands or Bands.empty(first, plan.bands, plan.samples, plan.left + plan.right + 1)
        if state.phase <= 2:
            for batch in _run(model, plan, source, mine, state, sites, "features: pass 2 (bands)", progress):
                bands_state.add(batch, seed=plan.seed, left=plan.left)
                state.passed(batch.index, local, bands_state)
            state.save(local, bands_state, phase=3, at=0)
        bands_state = _merge_all(bands_state)
        if sites is not None:
            sites.clear()
    writes, logits = _logits.effects(model, plan.bound)
    report = UnitReport(
        labels=[label for b in plan.bound for label in b.labels],
        settings=settings,
        first=first,
        band_samples=bands_state,
        writes=writes,
        logits=logits,
        documents=source.documents,
        tokenizer=tokenizer,
        sources=[b.source for b in plan.bound],
    )
    _warn_about(report)
    return report


# -- settings -------------------------------------------------------------------------------------------------------


def _plan(
    model: nn.Module,
    units: Any,
    tokenizer: Any,
    k: int,
    context: tuple[int, int],
    bands: int,
    samples: int,
    min_gap: int | None,
    exclude: Sequence[int] | None,
    seed: int,
) -> _Plan:
    """The checked settings of a pass."""
    for name, value, low in (("k", k, 1), ("bands", bands, 0), ("samples", samples, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")
    if (
        not isinstance(context, (tuple, list))
        or len(context) != 2
        or not all(isinstance(c, int) and c >= 0 for c in context)
    ):
        raise ValueError(f"`context` must be (left, right), two integers >= 0; got {context!r}")
    left, right = int(context[0]), int(context[1])
    gap = left + right + 1 if min_gap is None else min_gap
    if not isinstance(gap, int) or gap < 0:
        raise ValueError(f"`min_gap` must be an integer >= 0 or None; got {min_gap!r}")
    excluded = [] if exclude is None else [int(p) for p in exclude]
    return _Plan(
        bound=bind_all(model, units),
        k=k,
        left=left,
        right=right,
        gap=gap,
        bands=bands,
        samples=samples,
        seed=seed,
        special=_special_ids(model, tokenizer),
        exclude=excluded,
    )


def _special_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """BOS, EOS and pad ids: the tokenizer's, else the model config's."""
    found: set[int] = set()
    for holder in (tokenizer, getattr(model, "config", None)):
        if holder is None:
            continue
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(holder, name, None)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    found.add(v)
        if found:
            break
    return sorted(found)


def _paired(coactivation: bool | None, bound: list[Bound]) -> torch.Tensor | None:
    """The units whose co-activation sums are kept: all (``True``), none (``False``), or the dictionary features."""
    numbers = torch.arange(sum(b.width for b in bound))
    if coactivation is not None:
        return numbers if coactivation else None
    kinds = torch.cat([torch.full((b.width,), b.source.get("kind") == "feature") for b in bound])
    chosen = numbers[kinds]
    return chosen if 0 < len(chosen) <= 8192 else None


def _span(numbers: torch.Tensor) -> str:
    """A short text for a set of unit numbers (``"4608 units, 1536..6143"`` when consecutive)."""
    first, last = int(numbers[0]), int(numbers[-1])
    if last - first + 1 == len(numbers):
        return f"{len(numbers)} units, {first}..{last}"
    return f"{len(numbers)} units, {hashlib.sha256(str(numbers.tolist()).encode()).hexdigest()[:12]}"


def _settings(plan: _Plan, model: nn.Module, source: _Source, paired: torch.Tensor | None) -> dict[str, Any]:
    """What a resumed run must share with the run it continues, by name."""
    from ..datasets import model_digest

    return {
        "units": [b.identity for b in plan.bound],
        "k": plan.k,
        "context": [plan.left, plan.right],
        "min_gap": plan.gap,
        "bands": plan.bands,
        "samples": plan.samples,
        "seed": plan.seed,
        "special_ids": plan.special,
        "exclude": plan.exclude,
        "coactivation": None if paired is None else _span(paired),
        "batch_size": source.batch_size,
        "data": source.identity,
        "model": model_digest(model),
    }


# -- the data -------------------------------------------------------------------------------------------------------


class _Source:
    """The documents, batch by batch: ``(index, first document, ids, model inputs, attention mask or None)``."""

    def __init__(self, tokens: Any, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be an integer >= 1; got {batch_size!r}")
        self.tokens = tokens
        self.documents = 0
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex():
                raise TypeError(
                    f"`tokens` must be token ids (documents, tokens), an integer tensor; got {_kind(tokens)}"
                )
            if tokens.shape[0] == 0 or tokens.shape[1] == 0:
                raise ValueError(f"`tokens` is empty (shape {tuple(tokens.shape)}): give at least one document")
            from ..datasets import tensor_digest

            self.batch_size: int | None = batch_size
            self.identity = f"tensor {tuple(tokens.shape)} {tensor_digest(tokens)}"
            self.count: int | None = -(-tokens.shape[0] // batch_size)
            self.documents = tokens.shape[0]
        elif _rows(tokens):
            if len(tokens) == 0:
                raise ValueError("`tokens` holds no documents: give at least one")
            self.batch_size = batch_size
            self.identity = f"{type(tokens).__name__} of {len(tokens)} documents (checked as read)"
            self.count = -(-len(tokens) // batch_size)
            self.documents = len(tokens)
        elif isinstance(tokens, Iterable) and not isinstance(tokens, (str, bytes, dict)):
            self.batch_size = None
            self.identity = "batches (checked as read)"
            self.count = len(tokens) if isinstance(tokens, (DataLoader, Sequence)) else None
        else:
            raise TypeError(
                "`tokens` must be a (documents, tokens) tensor of token ids or a DataLoader/iterable of such batches; "
                f"got {type(tokens).__name__}"
            )

    def share(self, rank: int, world: int) -> range | None:
        """This process's batches: a contiguous share (``None``: all, in one process)."""
        if world == 1:
            return None
        if self.count is None:
            raise ValueError("under torchrun `tokens` must have a length (a tensor or a DataLoader) to be shared")
        return range(rank * self.count // world, (rank + 1) * self.count // world)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, Any, torch.Tensor | None]]:
        if isinstance(self.tokens, torch.Tensor) and self.batch_size is not None:
            for start in range(0, self.tokens.shape[0], self.batch_size):
                ids = self.tokens[start : start + self.batch_size]
                yield start, ids, ids, None
            return
        if _rows(self.tokens) and self.batch_size is not None:
            for start in range(0, len(self.tokens), self.batch_size):
                ids, inputs, mask = _one_batch(_as_tensors(self.tokens[start : start + self.batch_size]))
                yield start, ids, inputs, mask
            return
        first = 0
        for item in self.tokens:
            ids, inputs, mask = _one_batch(item)
            yield first, ids, inputs, mask
            first += ids.shape[0]
        self.documents = first
        if not first:
            raise ValueError("`tokens` gave no batches: give at least one document")


def _rows(tokens: Any) -> bool:
    """Whether ``tokens`` is a sliceable store of documents rather than batches.

    A memory-mapped array (token ids written once by a tokenizing step), an HF dataset: ``tokens[i:j]`` gives the
    rows, as an array or a dict with ``input_ids``.
    """
    sliceable = hasattr(tokens, "__len__") and hasattr(tokens, "__getitem__")
    return sliceable and not isinstance(tokens, (torch.Tensor, DataLoader, list, tuple, str, bytes, dict))


def _as_tensors(rows: Any) -> Any:
    """A slice of a store of documents as a tensor, or a dict of tensors (``input_ids``, ``attention_mask``)."""
    if isinstance(rows, dict):
        return {name: _as_tensors(value) for name, value in rows.items() if name in ("input_ids", "attention_mask")}
    return rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.array(rows))  # a copy of the slice


def _one_batch(item: Any) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """``(ids, model inputs, attention mask)`` of one batch of a DataLoader."""
    ids: torch.Tensor
    inputs: Any
    if isinstance(item, (list, tuple)) and item and isinstance(item[0], torch.Tensor):
        item = item[0]  # (ids, labels) pairs
    if isinstance(item, torch.Tensor):
        ids, inputs, mask = item, item, None
    elif isinstance(item, dict) and isinstance(item.get("input_ids"), torch.Tensor):
        ids, inputs, mask = item["input_ids"], item, item.get("attention_mask")
    else:
        raise TypeError(
            "each batch of `tokens` must be token ids (documents, tokens) or a dict with 'input_ids'; got "
            + _kind(item)
        )
    if ids.dim() != 2 or ids.is_floating_point():
        raise TypeError(f"a batch of `tokens` must be integer token ids (documents, tokens); got {_kind(ids)}")
    return ids, inputs, mask


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(x: Any) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


# -- resuming -------------------------------------------------------------------------------------------------------


class _Resume:
    """The checkpoint of a run: read at the start (settings checked by name), written as the run goes."""

    def __init__(self, path: Path | None, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = settings
        self.phase, self.at, self.digest = 1, 0, ""
        self.first: FirstPass | None = None
        self.bands: Bands | None = None
        self.chain = hashlib.sha256()
        self.since = 0
        if path is None or not path.exists():
            return
        state = read_verified(path)
        saved = state["settings"]
        for name, value in settings.items():
            if saved.get(name) != value:
                raise ValueError(
                    f"`checkpoint` {str(path)!r} holds a run with another `{name}` ({_short(saved.get(name))}, now "
                    f"{_short(value)}): give the same settings to resume it, or another checkpoint path to start anew"
                )
        report = UnitReport.from_state(state)
        self.phase, self.at, self.digest = int(state["phase"]), int(state["at"]), str(state["digest"])
        self.first, self.bands = report.first, report.band_samples

    def passed(self, index: int, first: FirstPass, bands: Bands | None) -> None:
        """One batch done; a checkpoint every :data:`CHECKPOINT_EVERY`."""
        self.since += 1
        if self.since >= CHECKPOINT_EVERY:
            self.save(first, bands, phase=self.phase, at=index + 1, digest=self.chain.hexdigest())

    def save(self, first: FirstPass, bands: Bands | None, *, phase: int, at: int, digest: str = "") -> None:
        """Write the state (the current pass resumes at batch ``at``)."""
        self.since = 0
        if phase != self.phase:
            self.phase, self.at, self.digest, self.chain = phase, 0, "", hashlib.sha256()
        if self.path is None:
            return
        report = UnitReport(labels=[], settings=self.settings, first=first, band_samples=bands)
        write_verified(self.path, {**report.state(), "phase": phase, "at": at, "digest": digest})


# -- the forward ----------------------------------------------------------------------------------------------------


def _run(
    model: nn.Module,
    plan: _Plan,
    source: _Source,
    mine: range | None,
    state: _Resume,
    cache: SiteCache | None,
    desc: str,
    progress: bool,
) -> Iterator[Batch]:
    """The batches of this process that the run has not done yet, with the units' activations.

    With a ``cache`` the first pass keeps the sites' tensors and the second reads them instead of running the model.
    """
    for index, (first, ids, inputs, mask) in enumerate(progress_bar(source, desc=desc, enabled=progress,
                                                                    total=source.count)):  # fmt: skip
        if index == state.at and state.digest and state.chain.hexdigest() != state.digest:
            raise ValueError(
                f"`tokens` differ from those of the run in `checkpoint` before batch {index}: give the same data "
                "to resume, or another checkpoint path to start anew"
            )
        state.chain.update(f"{tuple(ids.shape)}".encode())
        state.chain.update(ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
        if index == 0 and state.phase == 1 and ids.shape[1] < plan.left + plan.right + 1:
            warn(
                f"the documents have {ids.shape[1]} tokens, shorter than the context ({plan.left} + 1 + {plan.right}): "
                "the examples' contexts are cut at the documents' ends; give longer documents or a shorter `context`"
            )
        if index < state.at or (mine is not None and index not in mine):
            continue
        seen = cache.read(index, ids) if cache is not None and state.phase > 1 else None
        if seen is None:
            seen = _site_tensors(model, plan, inputs)
            if cache is not None and state.phase == 1 and plan.bands:
                cache.write(index, ids, seen)
        acts = _activations(plan, seen, ids)
        included = _included(ids, mask, plan)
        yield Batch(acts=acts, ids=ids.cpu().long(), included=included, first_document=first, index=index)


def _site_tensors(model: nn.Module, plan: _Plan, inputs: Any) -> Sites:
    """Every site's tensor in one forward, stopped once all are read."""
    sites = sorted({(b.module, b.side) for b in plan.bound})
    seen: Sites = {}
    with HookedRun(model, "feature_statistics") as run:
        for module, side in sites:

            def read(x: torch.Tensor, name: str, call: int, key: tuple[str, str] = (module, side)) -> None:
                if call == 0:
                    seen[key] = x.detach()
                if len(seen) == len(sites):
                    raise _Stop("every site was read")

            hook_site(run.group, module, side, None, read)
        try:
            run.forward(inputs)
        except _Stop:
            pass
    return seen


def _activations(plan: _Plan, seen: Sites, ids: torch.Tensor) -> torch.Tensor:
    """``(units, documents, tokens)`` float32: every unit's activations from the sites' tensors."""
    parts = []
    for b in plan.bound:
        if (b.module, b.side) not in seen:
            raise ValueError(
                f"the {b.side} of {b.module!r} was not read in the forward: choose a module the model calls"
            )
        x = seen[(b.module, b.side)]
        if x.dim() != 3 or tuple(x.shape[:2]) != tuple(ids.shape):
            raise ValueError(
                f"the {b.side} of {b.module!r} has shape {tuple(x.shape)}; units are read at (documents, tokens, "
                f"width) = ({ids.shape[0]}, {ids.shape[1]}, ...)"
            )
        parts.append(b.encode(x).float())  # type: ignore[operator]
    return torch.cat(parts, dim=-1).permute(2, 0, 1).cpu().contiguous()


def _included(ids: torch.Tensor, mask: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
    """``(documents, tokens)`` the positions that count."""
    ids = ids.cpu()
    included = ~torch.isin(ids, torch.tensor(plan.special, dtype=ids.dtype))
    if mask is not None:
        included &= mask.cpu().bool()
    if plan.exclude:
        positions = torch.tensor(plan.exclude) % ids.shape[1]
        included[:, positions] = False
    return included


# -- the end --------------------------------------------------------------------------------------------------------


def _merge_all(part: Any) -> Any:
    """The parts of every process merged in rank order (the part itself in one process)."""
    parts = _distributed.all_gather(part)
    merged = parts[0]
    for other in parts[1:]:
        merged = merged.merge(other)
    return merged


def _warn_about(report: UnitReport) -> None:
    """Warnings for what a user would otherwise miss: NaN values, positions too short for the context."""
    nans = int(report.nans.sum())
    if nans:
        where = ", ".join(f"document {d} position {p} unit {u}" for d, p, u in report.nan_at[:3])
        warn(
            f"{nans} activation(s) were NaN and are left out of every statistic (first: {where}); check those "
            "documents and the model for NaN or inf"
        )
    if not bool((report.count > 0).any()):
        warn(
            "no position was included: every token is a BOS/EOS/pad id or excluded; check `exclude` and the "
            "tokenizer's special ids"
        )
