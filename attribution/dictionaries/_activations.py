"""Activations to train on: recorded into the dataset store or given; rows read by index, bad rows left out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from .._run import Element, HookedRun, eager_module, hook_site, warn
from ..datasets import Results, attribute_dataset, open_results


class _Stop(Exception):
    """Raised by the recording hook once the site has run: the rest of the forward is skipped."""


class SiteRecorder:
    """``recorder(tokens) -> (batch, tokens, width)``: a site's activations in one forward of the model.

    A transcoder's rows hold the module's input and output side by side; the ``repr`` is what the store fingerprints.
    """

    def __init__(self, model: nn.Module, site: str, *, both: bool, element: Element = None) -> None:
        self.model = model
        self.site = site
        self.both = both
        self.element = element

    def __call__(self, inputs: Any) -> torch.Tensor:
        got: dict[str, torch.Tensor] = {}

        def output(x: torch.Tensor, name: str, call: int) -> None:
            got["output"] = x
            raise _Stop("the site was recorded")  # nothing after the site is needed: the forward stops here

        with HookedRun(eager_module(self.model), "train_dictionary.record") as run:
            hook_site(run.group, self.site, "output", self.element, output)
            if self.both:
                hook_site(run.group, self.site, "input", None, lambda x, n, c: got.__setitem__("input", x))
            try:
                run.forward(inputs)
            except _Stop:
                pass
        if "output" not in got:
            raise ValueError(
                f"`site` {self.site!r} did not run during the forward pass: choose a module the model calls"
            )
        parts = [got["input"], got["output"]] if self.both else [got["output"]]
        return torch.cat([p.detach().float() for p in parts], dim=-1)

    def __repr__(self) -> str:
        what = "input and output" if self.both else "output"
        return f"SiteRecorder(site={self.site!r}, {what}, element={self.element!r})"


def record_shards(
    model: nn.Module, data: Any, site: str, out: Path, *, both: bool, batch_size: int, progress: bool
) -> Results:
    """Record ``site`` over ``data`` into ``out`` with the dataset store (fingerprinted, verified, resumable)."""
    dataset: Any = data if isinstance(data, DataLoader) else _items(data)
    return attribute_dataset(
        SiteRecorder(model, site, both=both),
        dataset,
        out,
        batch_size=None if isinstance(data, DataLoader) else batch_size,
        model=model,
        topk=0,
        progress=progress,
    )


def _items(data: Iterable[Any]) -> torch.Tensor | list[dict[str, torch.Tensor]]:
    """Batches of model inputs as the store's items: one tensor, or one dict per item for dict batches.

    Token ids ``(batch, tokens)`` (or any tensors of one item shape) are concatenated; dict batches (HuggingFace's
    ``[{"input_ids": ..., "attention_mask": ...}, ...]``) are cut into one dict per item, every entry kept.
    """
    batches: list[Any] = [data] if isinstance(data, (torch.Tensor, Mapping)) else list(data)
    if batches and all(isinstance(b, Mapping) for b in batches):
        return _dict_items(batches)
    if not batches or not all(isinstance(b, torch.Tensor) and b.dim() >= 2 for b in batches):
        raise TypeError(
            "`data` must be batches of model inputs: token ids (batch, tokens) as a tensor or an iterable of "
            "tensors, an iterable of dicts with 'input_ids' (batch, tokens), or a DataLoader; got "
            f"{_described(data, batches)}"
        )
    _one_item_shape([tuple(b.shape[1:]) for b in batches])
    return torch.cat(batches)


def _dict_items(batches: list[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """Dict batches cut into one dict per item; each batch needs ``input_ids`` ``(batch, tokens)``."""
    items: list[dict[str, torch.Tensor]] = []
    for i, batch in enumerate(batches):
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(
                f"`data` batch {i} is a dict whose 'input_ids' is {got}; each dict batch needs 'input_ids' of shape "
                f"(batch, tokens) (its keys: {sorted(batch)})"
            )
        if sorted(batch) != sorted(batches[0]):
            raise ValueError(f"`data` batch {i} has keys {sorted(batch)}, batch 0 {sorted(batches[0])}: give every "
                             "batch the same model inputs")  # fmt: skip
        rows = len(ids)
        wrong = {
            k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            for k, v in batch.items()
            if not isinstance(v, torch.Tensor) or v.shape[:1] != (rows,)
        }
        if wrong:
            raise ValueError(f"`data` batch {i}: {wrong} do not have the {rows} rows of 'input_ids'")
        items += [{k: v[r] for k, v in batch.items()} for r in range(rows)]
    _one_item_shape(sorted({tuple(item["input_ids"].shape) for item in items}))
    return items


def _one_item_shape(shapes: list[tuple[int, ...]]) -> None:
    """Refuse items of several shapes: the activation store keeps one shape per item."""
    shapes = sorted(set(shapes))
    if len(shapes) > 1:
        raise ValueError(
            f"`data` has batches of items of shapes {shapes}; the activation store keeps one shape per item: cut the "
            "text into sequences of one length"
        )


def _described(data: Any, batches: list[Any]) -> str:
    """What ``data`` holds, for an error: its type and its first batch's."""
    first = f" of {type(batches[0]).__name__}" if batches else " (empty)"
    return f"{type(data).__name__}{first}"


class Rows:
    """The activation rows to train on: ``rows[i]`` for an index array, NaN/inf rows left out (and warned about)."""

    def __init__(self, source: torch.Tensor | Results) -> None:
        if isinstance(source, torch.Tensor):
            if source.dim() != 2 or not source.is_floating_point():
                raise ValueError(f"activations must be a float tensor (rows, width); got {tuple(source.shape)}")
            self._tensor: torch.Tensor | None = source
            self._arrays: list[np.ndarray] = []
            self.width = source.shape[1]
            bad = (~torch.isfinite(source).all(dim=1)).nonzero().flatten().tolist()
            self.valid = np.flatnonzero(np.isin(np.arange(source.shape[0]), bad, invert=True))
            _warn_bad([f"row {i}" for i in bad])
            return
        self._tensor = None
        self._arrays = [arrays["maps"] for _, arrays in source.shards(fields=["maps"])]
        shape = source.maps.shape  # (items, tokens, width)
        if len(shape) != 3:
            raise ValueError(f"{source.path} holds maps of shape {shape[1:]} per item; activations are (tokens, width)")
        self._per_item, self.width, self._shard = shape[1], shape[2], int(source.settings["shard_size"])
        bad_items = sorted(source.failures)
        _warn_bad([f"item {i} ({source.failures[i]})" for i in bad_items])
        keep = np.isin(np.arange(len(source)), bad_items, invert=True)
        self.valid = np.flatnonzero(np.repeat(keep, self._per_item))

    def __len__(self) -> int:
        return len(self.valid)

    def take(self, order: np.ndarray) -> torch.Tensor:
        """The rows at positions ``order`` of :attr:`valid`, ``(len(order), width)`` float32."""
        flat = self.valid[order]
        if self._tensor is not None:
            return self._tensor[torch.from_numpy(flat)]
        out = np.empty((len(flat), self.width), dtype=np.float32)
        item, pos = flat // self._per_item, flat % self._per_item
        shard = item // self._shard
        for s in np.unique(shard):
            chosen = shard == s
            out[chosen] = self._arrays[int(s)][item[chosen] % self._shard, pos[chosen]]
        return torch.from_numpy(out)


def _warn_bad(what: list[str]) -> None:
    if what:
        warn(
            f"{len(what)} recorded activation(s) hold NaN or inf and are left out of training: "
            + "; ".join(what[:10])
            + ("; ..." if len(what) > 10 else "")
            + ". Check those items (and the model) for NaN or inf"
        )


def open_source(source: torch.Tensor | str | Path) -> Rows:
    """The rows of given activations: a tensor ``(rows, width)`` or a folder of recorded shards."""
    if isinstance(source, torch.Tensor):
        return Rows(source.detach())
    if isinstance(source, (str, Path)):
        return Rows(open_results(source, verify=True))
    raise TypeError(
        f"with model=None, `data` must be activations: a tensor (rows, width) or a folder of recorded shards; got "
        f"{type(source).__name__}"
    )
