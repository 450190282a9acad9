"""Scores of a large training set streamed to the dataset store: one row per training example, in shards.

The store (:func:`attribution.datasets.attribute_dataset`) runs a function over a map-style dataset's batches and
writes its rows to disk in shards, each atomically; a killed run resumes with the missing shards, and under
``torchrun`` each process computes its share of them. Here the function is a training batch's scores against the
test examples, ``(batch, n_test)``: memory holds one batch's gradients and the test examples' preconditioned
gradients, never the whole ``n_train x n_test`` matrix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..datasets import Results, attribute_dataset


class _Packed:
    """A collate function that wraps the collated batch in a 1-tuple, so the store passes it whole as the input."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> tuple[Any]:
        return (self.collate(items),)


def stream_rows(
    rows: Callable[[Any], torch.Tensor],
    train: Dataset[Any] | DataLoader[Any],
    out: str | Path,
    identity: list[str],
    *,
    batch_size: int,
    progress: bool,
    overwrite: bool,
) -> Results:
    """``rows(batch)`` of every training batch, stored under ``out`` (resumable; ``torchrun``-ready).

    ``identity``: what makes two runs the same computation (settings and digests); a resume with another identity
    is refused by the store.
    """
    if isinstance(train, DataLoader):
        dataset, collate, size = train.dataset, train.collate_fn, train.batch_size or batch_size
    elif isinstance(train, Dataset) or hasattr(train, "__getitem__"):
        dataset, collate, size = train, default_collate, batch_size
    else:
        raise TypeError(
            f"streaming scores needs a map-style Dataset (or a DataLoader of one) whose items can be resumed and "
            f"shared by index; got {type(train).__name__}. Use .scores(test, train) for batches held in memory"
        )
    loader = DataLoader(dataset, batch_size=size, collate_fn=_Packed(collate))
    name = "influence scores " + hashlib.sha256(repr(identity).encode()).hexdigest()[:16]

    def method(batch: Any) -> torch.Tensor:
        return rows(batch)

    return attribute_dataset(method, loader, out, topk=0, run_name=name, progress=progress, overwrite=overwrite)
