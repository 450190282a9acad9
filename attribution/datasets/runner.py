"""Attribution over a whole dataset, streamed to disk in shards: resumable, on one process or many (``torchrun``).

:func:`attribute_dataset` runs any attribution callable batch by batch over a ``Dataset`` or ``DataLoader`` and
writes the maps, with the targets used, the model's top classes and scores and each item's dataset index, to an
output directory; :func:`open_results` reads them back lazily, indexed by dataset index.

Storage is one directory per shard of ``shard_size`` consecutive dataset items, one ``.npy`` file per field. The
``.npy`` format (numpy's own, documented and stable) is memory-mapped on reading (``np.load(mmap_mode="r")``), so
one item is read without loading the rest, and it can be written as a stream, a header and then batch after batch,
which keeps memory constant whatever the shard size; numpy comes with torch, so this adds no dependency.
(``safetensors`` would need every tensor of a shard in memory at once to write it, and a new dependency.)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from tqdm.auto import tqdm

from hooks import HookManager, map_tensors, tensors

from .. import _distributed
from .._progress import DELAY, shown
from .._run import WarningScope, warn
from . import _lock
from ._identity import UNREADABLE, describe, item_digests, model_digest
from ._lock import InUseError
from ._shards import (
    FORMAT,
    MANIFEST,
    META,
    SETTINGS,
    SHARDS,
    VERSION,
    Column,
    Results,
    ShardWriter,
    file_record,
    is_complete,
    read_meta,
    shard_count,
    shard_damage,
    shard_dir,
    shard_rows,
    sync_dir,
    write_json,
)

__all__ = ["Column", "Results", "attribute_dataset", "open_results"]

DatasetTarget = Union[None, int, str, Sequence[int], torch.Tensor, Callable[[Any], torch.Tensor]]  # noqa: UP007
_STORAGE = (torch.float32, torch.float16)
_LABEL_KEYS = ("label", "labels")
_REPAIR = (
    "run attribute_dataset again with the same arguments: it recomputes the damaged shards (and only those) and "
    "rebuilds the manifest"
)
_SAMPLE = 64  # stored items whose data a resume checks (evenly spread over the skipped shards)
_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)  # fmt: skip


def attribute_dataset(
    method: Callable[..., torch.Tensor],
    data: Dataset[Any] | DataLoader[Any] | Sequence[Any],
    out: str | Path,
    *,
    batch_size: int | None = None,
    target: DatasetTarget = None,
    model: nn.Module | None = None,
    dtype: torch.dtype | str = torch.float32,
    topk: int = 5,
    shard_size: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    run_name: str | None = None,
    overwrite: bool = False,
) -> Results:
    """Run ``method`` over every item of ``data`` and stream the maps to ``out``; resumable; ``torchrun``-ready.

    Each batch's maps are written to disk as they come (constant memory) in shards of ``shard_size`` consecutive
    dataset items, each shard written atomically. Run again with the same arguments after an interruption (Ctrl-C,
    a killed process) and only the missing shards are computed; a shard is never half-read, never duplicated.

    Under ``torchrun`` the process group is initialised from the environment if it is not yet (gloo, plus NCCL with
    CUDA), and shard ``k`` is computed by rank ``k % world_size``: every item exactly once, no padding. The shards
    and their batches do not depend on the number of processes, so the results equal those of one process (bitwise
    with as many threads per process: other thread counts sum in another order, within a float16 step). The
    output directory must be on a file system that every process sees (for several machines, a shared one).

    Dataset items may be a tensor (the input), a tuple ``(input, label, ...)`` or a dict of model inputs (its
    ``"label"`` or ``"labels"`` entry is the label); a ``DataLoader``'s ``collate_fn`` can reshape anything else.

    Args:
        method: ``method(inputs, target) -> maps (batch, ...)``: a CAM, :class:`~attribution.GradientRollout`, or
            a function; a callable without a second parameter (:class:`~attribution.AttentionRollout`) gets
            ``method(inputs)``.
        data: a map-style ``Dataset`` (or a sequence), or a ``DataLoader`` whose loading options (workers,
            ``collate_fn``, pinned memory) are kept; items are taken in index order (a shuffling sampler is
            ignored), and a sampler over other items (a subset, ``drop_last=True``, a batch sampler) is refused.
        out: the output directory (created if needed).
        batch_size: items per call of ``method`` (default: the ``DataLoader``'s batch size).
        target: ``None``: each item's top class; an int: that class for all; ``"label"``: each item's label; a
            sequence or tensor of one class per dataset item; or a callable ``output -> (batch,)`` scores, passed
            to ``method`` as it is.
        model: the model whose output gives the top classes and scores (default: ``method.model``, which CAMs and
            rollouts have). Its output is observed during the method's own forward (the first one when the method
            runs the model several times, as Score-CAM does), through one forward hook removed when the run ends.
            Without a model no classes or scores are stored and the targets of ``target=None`` are -1.
        dtype: storage type of the maps: ``torch.float32`` or ``torch.float16`` (half the disk).
        topk: how many top classes (and their logits and probabilities) to store per item; 0 for none.
        shard_size: dataset items per shard (default: 1 to 16 batches, aiming at 64 shards so that processes can
            share them evenly, with at least 4 batches per shard when that still leaves 8 shards: each shard costs
            a directory and a few file syncs). Keep it a multiple of ``batch_size``: batches never cross shards.
        device: where the inputs go (default: the device of the model's first parameter, else left as they are).
        progress: show a tqdm progress bar on a terminal with items/s (on rank 0, counting its own share).
        run_name: a name (or version) for the run, stored with its settings. Needed to resume a run whose method
            or target holds values that cannot be read (shown as ``<unreadable ...>`` in the settings): the name
            then vouches that the computation is the same. Give the same name on every resume.
        overwrite: delete the results already in ``out`` and start over. Without it nothing stored is deleted:
            a resume that would compute something else (another model, method, target or data) is refused.

    Returns:
        The :class:`Results`, read lazily (as :func:`open_results` gives them).

    Raises:
        ValueError: ``out`` holds a run with other settings (model weights, method, target, data, ...), a bad
            ``target``, or maps of the wrong batch size.
        TypeError: an iterable-style dataset (it has no indices to resume from or to share between processes).

    Example:
        >>> import tempfile, torch, torchvision
        >>> from attribution import GradCAM, attribute_dataset
        >>> model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
        >>> images = torch.utils.data.TensorDataset(torch.randn(10, 3, 32, 32))
        >>> res = attribute_dataset(GradCAM(model, "layer3"), images, tempfile.mkdtemp(), batch_size=4,
        ...                         progress=False)
        >>> len(res), res.maps[7].shape, res.classes[7].shape
        (10, torch.Size([32, 32]), torch.Size([4]))
    """
    rank, world = _distributed.setup()
    out = Path(out)
    plan = _plan(method, data, batch_size, target, model, dtype, topk, shard_size, run_name)
    fixed = shard_size is not None
    with _claim(out, rank) as writable:
        if not writable:
            return _read_only(out, plan, fixed_shard_size=fixed)
        settings = _settle(out, plan.settings, fixed_shard_size=fixed, rank=rank, overwrite=overwrite)
        _compute(out, plan, settings, method, target, device, progress, rank, world)
    _distributed.barrier()
    return open_results(out)


def _compute(
    out: Path,
    plan: _Plan,
    settings: dict[str, Any],
    method: Callable[..., torch.Tensor],
    target: DatasetTarget,
    device: torch.device | str | None,
    progress: bool,
    rank: int,
    world: int,
) -> None:
    """Compute this process's missing (or damaged) shards and, on rank 0, write the manifest once all are there."""
    size = int(settings["shard_size"])
    mine = list(_distributed.share(shard_count(plan.items, size), rank, world))
    damaged = _damaged(out, mine, rank)
    todo = sorted({shard for shard in mine if not is_complete(out, shard)} | set(damaged))
    _check_items(out, plan, size, [shard for shard in mine if shard not in todo])
    batches = [
        list(range(start, min(start + plan.batch_size, rows.stop)))
        for rows in (shard_rows(plan.items, size, shard) for shard in todo)
        for start in range(rows.start, rows.stop, plan.batch_size)
    ]
    if device is None and plan.observed is not None:
        device = next((p.device for p in plan.observed.parameters()), None)
    run = _Batch(method, plan.takes_target, target, plan.per_item, plan.storage, int(settings["topk"]), device)
    total = sum(len(shard_rows(plan.items, size, shard)) for shard in mine)
    bar = tqdm(
        total=total,
        initial=total - sum(len(b) for b in batches),
        unit="item",
        desc="attribute_dataset" + (f" (rank 0 of {world})" if world > 1 else ""),
        disable=not shown(progress and rank == 0),
        dynamic_ncols=True,
        delay=DELAY,
    )
    meta = {"rank": rank, "world": world, "host": socket.gethostname(), "settings": settings}
    _write_shards(out, plan, size, batches, run, bar, meta)
    sync_dir(out / SHARDS)
    gathered = _distributed.all_gather([read_meta(out, shard) for shard in mine])
    if rank == 0:
        _write_manifest(out, settings, [shard_meta for rank_metas in gathered for shard_meta in rank_metas])


@dataclass(frozen=True)
class _Plan:
    """A run's checked arguments and the settings that a resumed run must match."""

    dataset: Any
    options: dict[str, Any]  # DataLoader options kept from a given loader
    batch_size: int
    items: int
    observed: nn.Module | None  # the model whose logits are recorded
    takes_target: bool
    per_item: torch.Tensor | None  # the class of each item, when given
    storage: torch.dtype
    settings: dict[str, Any]


def _plan(
    method: Callable[..., torch.Tensor],
    data: Any,
    batch_size: int | None,
    target: DatasetTarget,
    model: nn.Module | None,
    dtype: torch.dtype | str,
    topk: int,
    shard_size: int | None,
    run_name: str | None,
) -> _Plan:
    """Check every argument before anything runs or is written, and describe the run."""
    dataset, options, batch = _dataset(data, batch_size)
    items = len(dataset)
    observed = model if model is not None else getattr(method, "model", None)
    if observed is not None and not isinstance(observed, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module or None; got {type(observed).__name__}")
    takes_target = _takes_target(method)
    per_item = _check_target(target, items, takes_target)
    storage = _storage(dtype)
    if not isinstance(topk, int) or topk < 0:
        raise ValueError(f"`topk` must be an int >= 0; got {topk!r}")
    if shard_size is not None and (not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"`shard_size` must be a positive int; got {shard_size!r}")
    settings: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "items": items,
        "shard_size": shard_size or _default_shard_size(items, batch),
        "dtype": str(storage).removeprefix("torch."),
        "topk": topk,
        "target": _describe_target(target, per_item),
        "method": _describe_method(method, observed),
        "model": None if observed is None else f"{type(observed).__name__} (weights {model_digest(observed)})",
        "run_name": run_name,
    }
    if run_name is not None and not isinstance(run_name, str):
        raise TypeError(f"`run_name` must be a str or None; got {type(run_name).__name__}")
    return _Plan(dataset, options, batch, items, observed, takes_target, per_item, storage, settings)


def _write_shards(
    out: Path, plan: _Plan, size: int, batches: list[list[int]], run: _Batch, bar: Any, meta: dict[str, Any]
) -> None:
    """Compute ``batches`` and stream them into their shards; a finished shard is published in a thread.

    A shard is fsynced and renamed in a thread while the next batches compute, one at a time; on any error (or
    ``KeyboardInterrupt``) the shard being written is removed and the bar closed.
    """
    writer: ShardWriter | None = None
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="hookscope-shards") as publisher,
        _observing(plan.observed) as observer,
    ):
        published: Future[None] | None = None
        try:
            if batches:
                loader = DataLoader(plan.dataset, batch_sampler=batches, **plan.options)
                for indices, batch in zip(batches, loader, strict=True):
                    if writer is None:
                        shard = indices[0] // size
                        writer = ShardWriter(out, shard, len(shard_rows(plan.items, size, shard)))
                    columns = run(batch, indices, observer)
                    writer.append(columns, item_digests(batch, len(indices)), run.failures)
                    if writer.written == writer.rows:
                        if published is not None:
                            published.result()  # raises what went wrong there
                        published = publisher.submit(writer.commit, meta)
                        writer = None
                    bar.update(len(indices))
            if published is not None:
                published.result()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            bar.close()


def open_results(out: str | Path, *, verify: bool = False) -> Results:
    """The results that :func:`attribute_dataset` wrote to ``out``, read lazily and indexed by dataset index.

    Every file is checked cheaply against the manifest (its size, and the array its ``.npy`` header announces);
    ``verify=True`` also compares each file's SHA-256 with the one recorded when it was written (reads everything).

    Args:
        out: the output directory of a finished run.
        verify: check every file's checksum too.

    Returns:
        The :class:`Results`: ``len(res)``, ``res.maps[i]``, ``res.targets[i]``, ``res.classes[i]``, ...

    Raises:
        FileNotFoundError: ``out`` holds no results, or a run that has not finished (run it again to finish it).
        ValueError: a damaged file (named in the message; running :func:`attribute_dataset` again with the same
            arguments recomputes the damaged shards and rebuilds the manifest).

    Example:
        >>> import tempfile, torch
        >>> from attribution import attribute_dataset, open_results
        >>> out = tempfile.mkdtemp()
        >>> _ = attribute_dataset(lambda x, t: x.mean(1), torch.rand(6, 3, 4, 4), out, batch_size=4, progress=False)
        >>> res = open_results(out)
        >>> len(res), res.maps[5].shape, res.fields
        (6, torch.Size([4, 4]), ('maps', 'index', 'targets'))
    """
    out = Path(out)
    path = out / MANIFEST
    if not path.is_file():
        settings = _read(out / SETTINGS)
        if settings is not None:
            count = shard_count(settings["items"], settings["shard_size"])
            done = sum(is_complete(out, shard) for shard in range(count))
            raise FileNotFoundError(
                f"the run in {out} has not finished ({done} of {count} shards written): call attribute_dataset "
                "again with the same arguments to finish it; it resumes where it stopped"
            )
        raise FileNotFoundError(
            f"{out} holds no attribution results (no {MANIFEST}); write them with attribute_dataset(method, data, out)"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is damaged ({exc}); {_REPAIR}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a results manifest of this version (format {manifest.get('format')!r}, version "
            f"{manifest.get('version')!r}; this library reads {FORMAT!r} version {VERSION})"
        )
    for entry in manifest["shards"]:
        if entry.get("files") is not None:
            problem = shard_damage(out, entry["shard"], full=verify, entry=entry)
            if problem:
                raise ValueError(f"{problem}; {_REPAIR}")
    return Results(out, manifest)


# -- one batch ----------------------------------------------------------------------------------------------------
class _Batch:
    """Computes one batch: inputs to the device, the target for the method, maps and observed logits as arrays."""

    def __init__(
        self,
        method: Callable[..., torch.Tensor],
        takes_target: bool,
        target: DatasetTarget,
        per_item: torch.Tensor | None,
        storage: torch.dtype,
        topk: int,
        device: torch.device | str | None,
    ) -> None:
        self.method = method
        self.takes_target = takes_target
        self.target = target
        self.per_item = per_item
        self.storage = storage
        self.topk = topk
        self.device = device
        self.warned_overflow = False
        self.failures: dict[int, str] = {}  # dataset index -> why, for the last batch
        self.warnings = WarningScope("attribute_dataset warns once per cause in a run")  # the method's warnings

    def __call__(self, batch: Any, indices: list[int], observer: _Observer) -> dict[str, np.ndarray]:
        inputs, labels = _split(batch)
        if self.device is not None:
            inputs = map_tensors(lambda x: x.to(self.device, non_blocking=True), inputs)
        given = self._target(labels, indices)
        self.warnings.note = (
            f"attribute_dataset warns once per cause in a run; first seen in the batch of dataset items {indices[0]} "
            f"to {indices[-1]}, which a method's own messages number from 0"
        )
        observer.start()
        with self.warnings.active():
            maps = self.method(inputs, given) if self.takes_target else self.method(inputs)
        if not isinstance(maps, torch.Tensor) or maps.dim() == 0 or maps.shape[0] != len(indices):
            got = f"shape {tuple(maps.shape)}" if isinstance(maps, torch.Tensor) else type(maps).__name__
            raise ValueError(
                f"`method` must return a tensor of maps (batch, ...) with one map per item; for a batch of "
                f"{len(indices)} items it returned {got}"
            )
        stored = maps.detach().to("cpu", self.storage)
        if self.storage == torch.float16 and not self.warned_overflow and _overflows(maps, stored):
            warn(
                "maps exceed float16's range (65504) and are stored as inf; store them with dtype=torch.float32",
            )
            self.warned_overflow = True
        logits = observer.logits
        self.failures = _nonfinite(inputs, logits, maps, indices)
        if self.failures:
            stored[[indices.index(i) for i in self.failures]] = float("nan")  # never a valid-looking map
            warn(
                "; ".join(f"item {index}: {why}" for index, why in sorted(self.failures.items()))
                + ". Their maps are stored as NaN and listed in `results.failures`; check those items (and the "
                "model) for NaN or inf",
            )
        columns = {"maps": stored.numpy(), "index": np.asarray(indices, dtype=np.int64)}
        columns["targets"] = self._used(given, logits, len(indices))
        if logits is not None and self.topk:
            top = logits.topk(min(self.topk, logits.shape[1]), dim=1)
            columns["classes"] = top.indices.cpu().numpy().astype(np.int64)
            columns["scores"] = top.values.cpu().numpy()
            columns["probs"] = logits.softmax(dim=1).gather(1, top.indices).cpu().numpy()
        return columns

    def _target(self, labels: Any, indices: list[int]) -> Any:
        """What the method receives as ``target`` for this batch."""
        if isinstance(self.target, str):
            if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.is_floating_point():
                got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else labels
                raise ValueError(
                    "target='label' needs items (input, label, ...) or dicts with a 'label' entry, with integer "
                    f"class labels (a (batch,) tensor once batched); got labels {got}"
                )
            return labels.long()
        if self.per_item is not None:
            return self.per_item[indices]
        return self.target

    def _used(self, given: Any, logits: torch.Tensor | None, batch: int) -> np.ndarray:
        """The class each map explains: the given ones, the top class for ``None``, -1 where unknown."""
        if given is None:
            used = logits.argmax(dim=1) if logits is not None else torch.full((batch,), -1)
        elif isinstance(given, int):
            used = torch.full((batch,), given)
        elif isinstance(given, torch.Tensor):
            used = given
        else:  # a callable target: scores of anything, no class
            used = torch.full((batch,), -1)
        return used.cpu().numpy().astype(np.int64)


class _Observer:
    """The ``(batch, classes)`` logits of the model's first forward since :meth:`start` (None if not logits)."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None
        self.calls = 0

    def start(self) -> None:
        """Forget the last batch: the next forward is the first one."""
        self.logits, self.calls = None, 0

    def keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            logits = getattr(output, "logits", output)
            if isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point():
                self.logits = logits.detach().float()


@contextmanager
def _observing(model: nn.Module | None) -> Iterator[_Observer]:
    """An observer of ``model``'s output through one forward hook, removed at exit (none without a model)."""
    observer = _Observer()
    if model is None:
        yield observer
        return
    with HookManager(model) as mgr:
        mgr.group("attribute_dataset.observe").forward("", observer.keep)
        yield observer


def _nonfinite(inputs: Any, logits: torch.Tensor | None, maps: torch.Tensor, indices: list[int]) -> dict[int, str]:
    """``{dataset index: why}`` for the items whose input, model output or map holds NaN or inf."""
    checks = [(leaf, "input") for leaf in tensors(inputs)] + [(logits, "model output"), (maps, "map")]
    failures: dict[int, str] = {}
    for tensor, what in checks:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0:
            continue
        if tensor.shape[0] != len(indices):
            continue
        bad = ~torch.isfinite(tensor.detach()).reshape(len(indices), -1).all(dim=1)
        for row in bad.nonzero().flatten().tolist():
            failures.setdefault(indices[row], f"{what} holds NaN or inf")
    return failures


def _overflows(maps: torch.Tensor, stored: torch.Tensor) -> bool:
    return bool(torch.isinf(stored).any()) and not bool(torch.isinf(maps).any())


def _split(batch: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` of a collated batch: a tensor, ``(input, label, ...)``, or a dict of inputs."""
    if isinstance(batch, Mapping):
        label = next((batch[k] for k in _LABEL_KEYS if k in batch), None)
        return {k: v for k, v in batch.items() if k not in _LABEL_KEYS}, label
    if isinstance(batch, (tuple, list)):
        return batch[0], batch[1] if len(batch) > 1 else None
    return batch, None


# -- checks and settings ------------------------------------------------------------------------------------------
def _dataset(data: Any, batch_size: int | None) -> tuple[Any, dict[str, Any], int]:
    """``(dataset, DataLoader options to keep, batch size)``, checked."""
    options: dict[str, Any] = {}
    dataset = data
    if isinstance(data, DataLoader):
        dataset = data.dataset
        _check_sampler(data)
        accepted = inspect.signature(DataLoader.__init__).parameters
        options = {k: getattr(data, k) for k in _LOADER_OPTIONS if k in accepted and hasattr(data, k)}
        if not options.get("num_workers"):
            options.pop("prefetch_factor", None)
        batch_size = batch_size if batch_size is not None else data.batch_size
        batch_size = batch_size if batch_size is not None else getattr(data.batch_sampler, "batch_size", None)
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"`data` is an iterable-style dataset ({type(dataset).__name__}): attribute_dataset needs indices to "
            "resume and to share items between processes. Give a map-style Dataset (with __len__ and __getitem__)"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(f"`data` must be a Dataset, a DataLoader or a sequence; got {type(data).__name__}")
    if batch_size is None:
        raise TypeError("`batch_size` is needed: give batch_size=..., or a DataLoader with a batch_size")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}")
    if len(dataset) == 0:
        raise ValueError("`data` is empty")
    return dataset, options, batch_size


def _check_sampler(loader: DataLoader[Any]) -> None:
    """Refuse a loader whose sampler takes another set of items than ``range(len(dataset))`` (never ignore it)."""
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", loader.sampler)
    why = ""
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        why = f"a batch sampler ({type(batch_sampler).__name__})"
    elif getattr(batch_sampler, "drop_last", False):
        why = "drop_last=True (it drops the last items)"
    elif isinstance(sampler, RandomSampler) and (
        sampler.replacement or sampler.num_samples != len(sampler.data_source)
    ):
        why = "a RandomSampler with replacement or num_samples (not every item once)"
    elif not isinstance(sampler, (SequentialSampler, RandomSampler)):
        why = f"a {type(sampler).__name__}"
    if why:
        raise ValueError(
            f"`data` is a DataLoader with {why}; attribute_dataset computes every item of the loader's dataset once, "
            "in index order, so that runs can resume and be shared between processes. To run on some items, pass "
            "torch.utils.data.Subset(dataset, indices) (in a DataLoader without a sampler, if you need its options)"
        )


def _takes_target(method: Callable[..., Any]) -> bool:
    """Whether ``method`` can be called as ``method(inputs, target)``."""
    if not callable(method):
        raise TypeError(f"`method` must be callable as method(inputs, target); got {type(method).__name__}")
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def _check_target(target: DatasetTarget, items: int, takes_target: bool) -> torch.Tensor | None:
    """Reject a bad ``target`` before anything runs; returns the per-item classes, if given."""
    if target is not None and not takes_target:
        raise ValueError(
            "`method` takes no target (it is called as method(inputs)), but `target` was given; leave target=None"
        )
    if target is None or callable(target) or isinstance(target, int):
        return None
    if isinstance(target, str):
        if target != "label":
            raise ValueError(f"`target` as a string must be 'label' (each item's label); got {target!r}")
        return None
    per_item = torch.as_tensor(target)
    if per_item.dim() != 1 or per_item.is_floating_point() or per_item.dtype == torch.bool:
        raise TypeError(
            f"`target` as a sequence must hold one integer class per dataset item, shape ({items},); got "
            f"{per_item.dtype} of shape {tuple(per_item.shape)}"
        )
    if len(per_item) != items:
        raise ValueError(f"`target` has {len(per_item)} entries but `data` has {items} items; give one per item")
    return per_item.long()


def _storage(dtype: torch.dtype | str) -> torch.dtype:
    chosen = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if chosen not in _STORAGE:
        raise ValueError(f"`dtype` must be torch.float32 or torch.float16 (or 'float32', 'float16'); got {dtype!r}")
    assert isinstance(chosen, torch.dtype)
    return chosen


def _default_shard_size(items: int, batch_size: int) -> int:
    """A multiple of ``batch_size``: 1 to 16 batches, aiming at 64 shards (enough to share among processes).

    At least 4 batches per shard while that leaves 8 shards or more, so that a small dataset does not pay a
    directory, a few file syncs and a manifest entry for every batch.
    """
    batches = math.ceil(items / batch_size)
    return batch_size * min(16, max(math.ceil(batches / 64), min(4, math.ceil(batches / 8)), 1))


def _describe_method(method: Callable[..., Any], observed: nn.Module | None) -> str:
    """The method as :func:`describe` gives it, with the weights of its own model when that is not ``observed``."""
    text = describe(method)
    own = getattr(method, "model", None)
    if isinstance(own, nn.Module) and own is not observed and "(weights " not in text:
        text += f" on {describe(own)}"
    return text


def _describe_target(target: DatasetTarget, per_item: torch.Tensor | None) -> str:
    if per_item is not None:
        digest = hashlib.sha256(per_item.numpy().astype(np.int64).tobytes()).hexdigest()[:16]
        return f"one class per item (sha256 {digest})"
    if target is None:
        return "top class"
    if isinstance(target, str):
        return "labels"
    if isinstance(target, int):
        return f"class {target}"
    return f"callable {describe(target)}"


def _settle(
    out: Path, settings: dict[str, Any], *, fixed_shard_size: bool, rank: int, overwrite: bool
) -> dict[str, Any]:
    """Record the run's settings in ``out``, or check them against those of the run being resumed."""
    path = out / SETTINGS
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite:
            _clear(out)
        if not path.exists():
            write_json(path, settings)
        elif _read(path) is None:
            _rebuild_settings(out, settings)
    _distributed.barrier()
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing here, though rank 0 wrote it: `out` must be on a file system that every process "
            "sees (for several machines, a shared one)"
        )
    stored = _read(path)
    if stored is None:
        raise ValueError(
            f"{path} is empty or damaged and no copy of it is left in the manifest or the shards, so what the "
            "stored results computed is unknown: start over with overwrite=True, or use another directory"
        )
    return _compare(out, stored, settings, fixed_shard_size=fixed_shard_size)


def _compare(out: Path, stored: dict[str, Any], settings: dict[str, Any], *, fixed_shard_size: bool) -> dict[str, Any]:
    """The run's settings if they match the ``stored`` ones (the stored shard size unless fixed); else an error."""
    if not fixed_shard_size and "shard_size" in stored:
        settings = {**settings, "shard_size": stored["shard_size"]}  # resuming with another batch size is fine
    differ = [key for key in settings if stored.get(key) != settings[key]]
    if differ:
        changes = "; ".join(f"{key}: {stored.get(key)!r} there, {settings[key]!r} now" for key in differ)
        raise ValueError(
            f"`out` {str(out)!r} holds a run with other settings ({changes}); resuming would mix two computations. "
            "Start over with overwrite=True (deletes the results there), or use another directory"
        )
    unreadable = [key for key in ("method", "target") if UNREADABLE in str(settings[key])]
    if unreadable and settings["run_name"] is None and _started(out):
        raise ValueError(
            f"cannot check that the run in `out` {str(out)!r} computed the same {' and '.join(unreadable)} as now: "
            f"{settings[unreadable[0]]!r} holds values that cannot be read. To resume deliberately, pass the same "
            "run_name=... on every run (it vouches for the computation); or start over with overwrite=True"
        )
    return settings


@contextmanager
def _claim(out: Path, rank: int) -> Iterator[bool]:
    """Rank 0 holds ``out``'s lock while the body runs (and first removes the leftovers of killed runs).

    Every process gets rank 0's verdict: writable, read-only (False), or in use (:class:`InUseError`).
    """
    with ExitStack() as stack:
        error, writable = "", True
        if rank == 0:
            try:
                writable = stack.enter_context(_lock.writer(out))
            except InUseError as exc:
                error = str(exc)
            if writable and not error:
                _lock.remove_stale(out)
        error, writable = _distributed.all_gather((error, writable))[0]
        if error:
            raise InUseError(error)
        yield writable


def _read_only(out: Path, plan: _Plan, *, fixed_shard_size: bool) -> Results:
    """The finished run in a folder that cannot be written, checked as a resume would check it; nothing written."""
    try:
        stored = _read(out / SETTINGS)
        if stored is None:
            raise ValueError(f"{out / SETTINGS} is missing, empty or damaged")
        settings = _compare(out, stored, plan.settings, fixed_shard_size=fixed_shard_size)
        results = open_results(out, verify=True)
        _check_items(out, plan, settings["shard_size"], list(range(shard_count(plan.items, settings["shard_size"]))))
    except (OSError, ValueError) as exc:
        raise PermissionError(
            f"`out` {str(out)!r} cannot be written (read-only), so only a finished run of the same settings can be "
            f"returned from it, and this one cannot: {exc}"
        ) from None
    return results


def _read(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if it is missing, empty or damaged."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rebuild_settings(out: Path, settings: dict[str, Any]) -> None:
    """Write a damaged ``settings.json`` again from its copy in the manifest or a shard (now's, if none started)."""
    copies = [(_read(out / MANIFEST) or {}).get("settings")]
    if (out / SHARDS).is_dir():
        copies += [(_read(p / META) or {}).get("settings") for p in sorted((out / SHARDS).iterdir())]
    copy = next((c for c in copies if isinstance(c, dict)), None)
    if copy is None and _started(out):
        return  # refused by the caller: nothing tells what the stored shards computed
    warn(f"{out / SETTINGS} was empty or damaged; written again from " + ("a copy" if copy else "this run"))
    write_json(out / SETTINGS, copy or settings)


def _started(out: Path) -> bool:
    """Whether ``out`` holds any complete shard."""
    return (out / SHARDS).is_dir() and any((p / META).is_file() for p in (out / SHARDS).iterdir())


def _clear(out: Path) -> None:
    """Delete the results in ``out`` (``overwrite=True``): the manifest first, then settings and shards."""
    for name in (MANIFEST, SETTINGS):
        (out / name).unlink(missing_ok=True)
    if (out / SHARDS).is_dir():
        shutil.rmtree(out / SHARDS)


def _damaged(out: Path, mine: list[int], rank: int) -> list[int]:
    """The complete shards of ``mine`` whose files fail their checksums: warned about, removed, to recompute."""
    damaged = {}
    for shard in mine:
        if shard_dir(out, shard).is_dir():
            complete = is_complete(out, shard)
            why = shard_damage(out, shard, full=True) if complete else f"{shard_dir(out, shard) / META} is missing"
            if why:
                damaged[shard] = why
    if damaged:
        warn(
            f"rank {rank}: {len(damaged)} stored shard(s) of `out` are damaged and are computed again: "
            + "; ".join(damaged.values()),
        )
    for shard in damaged:
        doomed = shard_dir(out, shard).with_name(f"{shard_dir(out, shard).name}.tmp-damaged")
        os.replace(shard_dir(out, shard), doomed)  # no longer complete, even if the removal is interrupted
        shutil.rmtree(doomed)
    return sorted(damaged)


def _check_items(out: Path, plan: _Plan, size: int, skipped: list[int]) -> None:
    """Check that the stored items a resume skips come from the same data: a sample of them, by digest."""
    stored: dict[int, str] = {}
    for shard in skipped:
        digests = read_meta(out, shard).get("digests", [])  # absent in shards of an older version
        stored.update(zip(shard_rows(plan.items, size, shard), digests, strict=False))
    if not stored:
        return
    indices = sorted(stored)
    sample = [indices[int(i)] for i in np.unique(np.linspace(0, len(indices) - 1, min(len(indices), _SAMPLE)))]
    chunks = [sample[i : i + plan.batch_size] for i in range(0, len(sample), plan.batch_size)]
    differ = []
    for chunk, batch in zip(chunks, DataLoader(plan.dataset, batch_sampler=chunks, **plan.options), strict=True):
        differ += [i for i, d in zip(chunk, item_digests(batch, len(chunk)), strict=True) if stored[i] != d]
    if differ:
        raise ValueError(
            f"`data` differs from the data of the run stored in `out` {str(out)!r}: items {differ[:10]} (of "
            f"{len(sample)} stored items checked) have other contents than when they were computed; resuming would "
            "mix two datasets. Start over with overwrite=True (deletes the results there), or use another directory"
        )


def _write_manifest(out: Path, settings: dict[str, Any], metas: list[dict[str, Any]]) -> None:
    """Check that every shard is there, with the same fields, and write the manifest (last)."""
    metas = sorted(metas, key=lambda meta: meta["shard"])
    count = shard_count(settings["items"], settings["shard_size"])
    if [meta["shard"] for meta in metas] != list(range(count)):
        raise RuntimeError(f"expected shards 0..{count - 1}; the processes reported {[m['shard'] for m in metas]}")
    fields = metas[0]["fields"]
    for meta in metas[1:]:
        if meta["fields"] != fields:
            raise ValueError(
                f"shard {meta['shard']} stores {meta['fields']} but shard 0 stores {fields}: parts of `out` were "
                "computed differently (another model output or map shape); start over in a new directory"
            )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "items": settings["items"],
        "shard_size": settings["shard_size"],
        "fields": fields,
        "settings": settings,
        "failures": {str(i): why for m in metas for i, why in sorted(m.get("failures", {}).items())},
        "shards": [
            {
                **{key: m.get(key) for key in ("shard", "rows", "rank", "host", "fields", "files")},
                "meta": file_record(shard_dir(out, m["shard"]) / META),
            }
            for m in metas
        ],
    }
    if _read(out / MANIFEST) != manifest:  # a finished run opened again writes nothing
        write_json(out / MANIFEST, manifest)
