"""Results on disk: shards of ``.npy`` files, each written atomically, read lazily through memory maps.

Layout of an output directory::

    settings.json          what the run computes (checked when a run resumes)
    shards/000000/         dataset items 0 .. shard_size - 1: maps.npy, targets.npy, index.npy, ..., meta.json
    shards/000001/         the next shard_size items, and so on
    shards/000002.tmp-...  a shard being written: never read, removed when its shard is written again
    manifest.json          written last, once every shard is complete

A shard is written into a temporary directory, one ``.npy`` file per field (the header first, then the rows batch
by batch, so memory stays constant), each file flushed and fsynced, then the directory is renamed to its final name;
the shards' directory is fsynced before the manifest is written. A shard directory that has its final name is
therefore complete; anything else is a leftover of an interrupted run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

FORMAT = "hookscope-attribution-results"
VERSION = 1
SETTINGS = "settings.json"
MANIFEST = "manifest.json"
META = "meta.json"
SHARDS = "shards"
OPEN_LIMIT = 64  # memory maps kept open at once (each holds a file descriptor)


def shard_dir(out: Path, shard: int) -> Path:
    """The final directory of shard number ``shard``."""
    return out / SHARDS / f"{shard:06d}"


def shard_rows(items: int, shard_size: int, shard: int) -> range:
    """The dataset indices that shard ``shard`` holds."""
    return range(shard * shard_size, min((shard + 1) * shard_size, items))


def shard_count(items: int, shard_size: int) -> int:
    """How many shards ``items`` dataset items make."""
    return -(-items // shard_size)


def is_complete(out: Path, shard: int) -> bool:
    """Whether shard ``shard`` was written completely (its directory has its final name)."""
    return (shard_dir(out, shard) / META).is_file()


def read_meta(out: Path, shard: int) -> dict[str, Any]:
    """The ``meta.json`` of a complete shard."""
    meta: dict[str, Any] = json.loads((shard_dir(out, shard) / META).read_text())
    return meta


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (where the platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """Make the renames inside ``path`` durable (where the platform can open a directory)."""
    _fsync_dir(path)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file, flushed and fsynced, then renamed."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    _write_synced(tmp, json.dumps(data, indent=1))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ShardWriter:
    """Streams the rows of one shard into ``.npy`` files in a temporary directory; :meth:`commit` publishes them."""

    def __init__(self, out: Path, shard: int, rows: int) -> None:
        self.final = shard_dir(out, shard)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.final.parent.glob(f"{self.final.name}.tmp-*"):  # left by an interrupted run
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = self.final.with_name(f"{self.final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        self.tmp.mkdir()
        self.shard = shard
        self.rows = rows
        self.written = 0
        self.files: dict[str, BinaryIO] = {}
        self.hashes: dict[str, Any] = {}  # a sha256 of each file, fed as it is written
        self.fields: dict[str, dict[str, Any]] = {}
        self.digests: list[str] = []
        self.failures: dict[str, str] = {}

    def append(
        self, columns: Mapping[str, np.ndarray], digests: Sequence[str] = (), failures: Mapping[int, str] = {}
    ) -> None:
        """Append one batch: every field ``(batch, ...)``, the same fields (dtypes, item shapes) every time.

        ``digests`` (one per item, of its data) and ``failures`` (dataset index -> why its map is not valid) are
        stored in the shard's ``meta.json``: the digests to check a resume, the failures for ``Results.failures``.
        """
        batch = {len(c) for c in columns.values()}
        if len(batch) != 1:
            raise ValueError(f"fields of one batch differ in length: { {k: len(c) for k, c in columns.items()} }")
        count = batch.pop()
        if self.written + count > self.rows:
            raise ValueError(f"shard {self.shard} holds {self.rows} rows; {self.written + count} were written")
        if not self.files:
            for name, column in columns.items():
                self._open(name, column)
        if set(columns) != set(self.files):
            raise ValueError(f"a batch has fields {sorted(columns)}; the shard was started with {sorted(self.files)}")
        for name, column in columns.items():
            spec = self.fields[name]
            if column.dtype.str != spec["dtype"] or list(column.shape[1:]) != spec["shape"]:
                raise ValueError(
                    f"`{name}` of this batch is {column.dtype} {tuple(column.shape[1:])} per item; earlier items "
                    f"were {np.dtype(spec['dtype'])} {tuple(spec['shape'])}: every item must have the same shape"
                )
            data = np.ascontiguousarray(column).data  # the buffer itself, no copy
            self.files[name].write(data)
            self.hashes[name].update(data)
        self.written += count
        self.digests += digests
        self.failures.update({str(index): why for index, why in failures.items()})

    def _open(self, name: str, column: np.ndarray) -> None:
        f = open(self.tmp / f"{name}.npy", "wb")  # closed in commit or abort
        header = {
            "descr": np.lib.format.dtype_to_descr(column.dtype),
            "fortran_order": False,
            "shape": (self.rows, *column.shape[1:]),
        }
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, header)
        f.write(buffer.getvalue())
        self.files[name] = f
        self.hashes[name] = hashlib.sha256(buffer.getvalue())
        self.fields[name] = {"dtype": column.dtype.str, "shape": list(column.shape[1:])}

    def commit(self, meta: Mapping[str, Any]) -> None:
        """Flush and fsync every file, then publish the shard under its final name (safe to run in a thread).

        The rename is made durable later, for all shards at once, by :func:`sync_dir` of the shards' directory: a
        rename lost in a crash before that only means the shard is computed again.
        """
        if self.written != self.rows:
            raise RuntimeError(f"shard {self.shard} got {self.written} of its {self.rows} rows")
        files = {}
        for name, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            files[f"{name}.npy"] = {"size": f.tell(), "sha256": self.hashes[name].hexdigest()}
            f.close()
        record = {
            "shard": self.shard,
            "rows": self.rows,
            "fields": self.fields,
            "files": files,
            **meta,
            "failures": self.failures,
            "digests": self.digests,
        }
        _write_synced(self.tmp / META, json.dumps(record))
        os.rename(self.tmp, self.final)

    def abort(self) -> None:
        """Close and delete the temporary directory (after an error or an interruption)."""
        for f in self.files.values():
            try:
                f.close()  # flushes: can fail on a full disk, and must not keep the rest from being cleaned
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def file_record(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def file_damage(path: Path, record: Mapping[str, Any], *, full: bool, shape: Sequence[int] | None = None) -> str:
    """What is wrong with ``path`` against its ``record`` ("" if nothing): size, ``.npy`` header, checksum if ``full``.

    ``shape`` (with the dtype string as ``record["dtype"]``) is the array the header must announce.
    """
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{path} has {size} bytes; {record['size']} were written (truncated or damaged)"
    if shape is not None:
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                announced, _, dtype = read(f)
        except Exception as exc:  # numpy's header parser raises ValueError, SyntaxError, tokenize errors, ...
            return f"{path} has a damaged .npy header ({type(exc).__name__}: {exc})"
        if tuple(announced) != tuple(shape) or dtype.str != record["dtype"]:
            return f"{path} announces {dtype} {tuple(announced)}; {record['dtype']} {tuple(shape)} were written"
    if full and file_record(path)["sha256"] != record["sha256"]:
        return f"{path} does not match its checksum (its contents are damaged)"
    return ""


def shard_damage(out: Path, shard: int, *, full: bool, entry: Mapping[str, Any] | None = None) -> str:
    """What is wrong with complete shard ``shard`` ("" if nothing); checked against its manifest ``entry`` if given.

    Without ``entry`` the shard's own ``meta.json`` is the record (as a resume has it, before any manifest).
    """
    directory = shard_dir(out, shard)
    try:
        meta = entry if entry is not None else read_meta(out, shard)
        if entry is not None and entry.get("meta"):
            problem = file_damage(directory / META, entry["meta"], full=full)
            if problem:
                return problem
    except (OSError, ValueError) as exc:
        return f"{directory / META} is damaged ({exc})"
    fields = meta.get("fields", {})
    for name, record in meta.get("files", {}).items():
        spec = fields.get(name.removesuffix(".npy"), {})
        shape = (meta["rows"], *spec.get("shape", ()))
        problem = file_damage(directory / name, {**record, "dtype": spec.get("dtype")}, full=full, shape=shape)
        if problem:
            return problem
    return ""


def _positions(key: Any, length: int) -> np.ndarray | int:
    """Item positions selected by ``key``: an int (returned as an int), a slice, ints, or a boolean mask."""
    if isinstance(key, torch.Tensor):
        key = key.cpu().numpy()
    if isinstance(key, np.ndarray) and key.ndim == 0 and np.issubdtype(key.dtype, np.integer):
        key = int(key)  # a 0-d index: one item, as numpy does
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        position = int(key)
        if not -length <= position < length:
            raise IndexError(f"index {position} is out of range for {length} items")
        return position % length
    if isinstance(key, slice):
        return np.arange(length)[key]
    array = np.asarray(key)
    if array.size == 0 and array.ndim == 1:
        return np.zeros(0, dtype=np.int64)  # no items: an empty result, as numpy gives
    if array.dtype == bool:
        if array.shape != (length,):
            raise IndexError(f"a boolean mask must have shape ({length},); got {array.shape}")
        return np.flatnonzero(array)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"index with an int, a slice, a sequence of ints or a boolean mask; got {type(key).__name__}"
            + (f" of dtype {array.dtype} and shape {array.shape}" if array.size else "")
        )
    bad = array[(array < -length) | (array >= length)]
    if bad.size:
        raise IndexError(f"index {int(bad[0])} is out of range for {length} items")
    return array % length


class Column:
    """One field of :class:`Results` (``maps``, ``targets``, ...), indexed by dataset index, read on access.

    ``column[i]`` is item ``i``'s value as a tensor; a slice, a sequence of indices or a boolean mask gives the
    stacked values. Only the shards holding the requested items are read (memory-mapped), nothing else.
    """

    def __init__(self, results: Results, name: str) -> None:
        self._results = results
        self.name = name
        spec = results._fields[name]
        self.dtype: torch.dtype = torch.from_numpy(np.empty(0, dtype=np.dtype(spec["dtype"]))).dtype
        self.shape: tuple[int, ...] = (len(results), *spec["shape"])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        size = self._results._shard_size
        positions = _positions(key, len(self))
        if isinstance(positions, int):
            array = self._results._array(positions // size, self.name)
            return torch.from_numpy(np.array(array[positions % size]))
        values = np.empty((len(positions), *self.shape[1:]), dtype=np.dtype(self._results._fields[self.name]["dtype"]))
        shards = positions // size
        for shard in np.unique(shards):
            chosen = shards == shard
            values[chosen] = self._results._array(int(shard), self.name)[positions[chosen] % size]
        return torch.from_numpy(values)

    def __iter__(self) -> Iterator[torch.Tensor]:
        size = self._results._shard_size
        for shard in range(shard_count(len(self), size)):
            for row in self._results._array(shard, self.name):
                yield torch.from_numpy(np.array(row))

    def __repr__(self) -> str:
        return f"<Column {self.name!r} {self.dtype} {self.shape}>"


class Results:
    """The results of :func:`attribution.attribute_dataset`, indexed by dataset index, read lazily from disk.

    ``len(results)`` is the number of dataset items; ``results.maps[i]`` is item ``i``'s map, ``results.targets[i]``
    the class it explains (-1 where unknown: a callable target, or ``target=None`` with no model to observe),
    ``results.classes[i]`` and ``results.scores[i]`` the model's top classes and their logits (``results.probs[i]``:
    their softmax probabilities), ``results.index[i]`` the dataset index stored with the item (``i``). Columns also
    take slices, sequences of indices and boolean masks (``results.maps[results.targets[:] == 3]``). Nothing is read
    before it is asked for: each shard's files are memory-mapped on first access (at most 64 kept open).

    Attributes:
        path: the output directory.
        fields: the stored fields, e.g. ``("maps", "targets", "index", "classes", "scores", "probs")``.
        settings: what the run computed (method, target, dtype, shard size, ...).
        failures: ``{dataset index: why}`` for the items whose input, model output or map held NaN or inf (their
            maps are stored as NaN).
    """

    def __init__(self, path: Path, manifest: Mapping[str, Any]) -> None:
        self.path = path
        self._items = int(manifest["items"])
        self._shard_size = int(manifest["shard_size"])
        self._fields: dict[str, dict[str, Any]] = dict(manifest["fields"])
        self.fields = tuple(self._fields)
        self.settings: dict[str, Any] = dict(manifest["settings"])
        self.failures: dict[int, str] = {int(i): why for i, why in manifest.get("failures", {}).items()}
        self._open: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self._items

    def column(self, name: str) -> Column:
        """The column ``name`` (one of :attr:`fields`)."""
        if name not in self._fields:
            why = ""
            if name in ("classes", "scores", "probs"):
                why = (
                    " (the model's classes and scores are stored when the method has a `.model` or `model=` is "
                    "given, `topk` > 0, and the model outputs (batch, classes) logits)"
                )
            raise KeyError(f"{self.path} has no field {name!r}; it has {list(self._fields)}{why}")
        return Column(self, name)

    @property
    def maps(self) -> Column:
        """The maps, ``(items, *map_shape)``."""
        return self.column("maps")

    @property
    def targets(self) -> Column:
        """The class each map explains, ``(items,)``; -1 where it is not known."""
        return self.column("targets")

    @property
    def index(self) -> Column:
        """The dataset index stored with each item, ``(items,)``."""
        return self.column("index")

    @property
    def classes(self) -> Column:
        """The model's top classes, best first, ``(items, topk)``."""
        return self.column("classes")

    @property
    def scores(self) -> Column:
        """The logits of :attr:`classes`, ``(items, topk)``."""
        return self.column("scores")

    @property
    def probs(self) -> Column:
        """The softmax probabilities of :attr:`classes`, ``(items, topk)``."""
        return self.column("probs")

    def shards(
        self, rank: int = 0, world: int = 1, fields: Sequence[str] | None = None
    ) -> Iterator[tuple[range, dict[str, np.ndarray]]]:
        """``(dataset indices, {field: memory-mapped array})`` of every ``world``-th shard from ``rank`` on.

        Args:
            rank: the first shard.
            world: the step between shards (``rank=r, world=w`` gives process ``r`` of ``w`` its share).
            fields: the fields to map (default: all).
        """
        names = list(self._fields) if fields is None else [self.column(name).name for name in fields]
        for shard in range(rank, shard_count(self._items, self._shard_size), world):
            rows = shard_rows(self._items, self._shard_size, shard)
            yield rows, {name: self._array(shard, name) for name in names}

    def _array(self, shard: int, name: str) -> np.ndarray:
        key = (shard, name)
        array = self._open.get(key)
        if array is not None:
            self._open.move_to_end(key)
            return array
        path = shard_dir(self.path, shard) / f"{name}.npy"
        try:
            array = np.load(path, mmap_mode="r")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} is missing, though {self.path / MANIFEST} lists it. When the ranks of a multi-machine run "
                f"write to disks of their own, copy every machine's {SHARDS}/ into one directory"
            ) from None
        self._open[key] = array
        while len(self._open) > OPEN_LIMIT:
            self._open.popitem(last=False)
        return array

    def __repr__(self) -> str:
        maps = self._fields.get("maps", {})
        return (
            f"<Results {str(self.path)!r}: {self._items} items, maps {tuple(maps.get('shape', ()))} "
            f"{np.dtype(maps.get('dtype', 'f4'))}, fields {list(self._fields)}>"
        )
