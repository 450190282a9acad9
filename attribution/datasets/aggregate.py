"""Aggregates over a dataset, each process reducing its own share, combined with ``torch.distributed`` collectives.

:func:`class_means` averages stored maps per class; :func:`mean_patching` averages a patching sweep
(:func:`~attribution.activation_patching`, or any function with its signature) over a dataset of prompt pairs.
Both work in one process as they are and, under ``torchrun``, split the work between the processes and return the
same result on every process (equal to one process's up to the order of float64 additions).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .. import _distributed
from .._progress import progress as progress_bar
from ..patching import activation_patching
from ._shards import Results

__all__ = ["ClassMeans", "PatchingMean", "class_means", "mean_patching"]

_CHUNK = 256  # rows of a shard summed at once (bounds the memory of a float64 copy)


@dataclass(frozen=True)
class ClassMeans:
    """The mean map of each class that occurs.

    Attributes:
        classes: the classes, ascending, ``(k,)``.
        means: their mean maps, ``(k, *map_shape)``, float64.
        counts: how many items each mean is over, ``(k,)``.
    """

    classes: torch.Tensor
    means: torch.Tensor
    counts: torch.Tensor

    def __getitem__(self, cls: int) -> torch.Tensor:
        """The mean map of class ``cls``."""
        found = (self.classes == cls).nonzero()
        if not len(found):
            raise KeyError(f"class {cls} has no items; classes present: {self.classes.tolist()}")
        return self.means[int(found[0, 0])]


def class_means(results: Results, *, by: Literal["targets", "classes"] = "targets") -> ClassMeans:
    """Mean map per class over all stored items, each process summing its own shards.

    Args:
        results: what :func:`attribution.open_results` (or :func:`attribution.attribute_dataset`) returns.
        by: group items by ``"targets"`` (the class each map explains; items with target -1 are left out) or by
            ``"classes"`` (the model's top class).

    Returns:
        :class:`ClassMeans` of the classes present, on every process.

    Example:
        >>> import tempfile, torch
        >>> from attribution import attribute_dataset
        >>> res = attribute_dataset(lambda x, t: x, torch.arange(4.0)[:, None], tempfile.mkdtemp(), batch_size=2,
        ...                         target=[0, 1, 1, 1], progress=False)
        >>> means = class_means(res)
        >>> means.classes, means.counts, means[1]
        (tensor([0, 1]), tensor([1, 3]), tensor([2.], dtype=torch.float64))
    """
    if by not in ("targets", "classes"):
        raise ValueError(f"`by` must be 'targets' or 'classes'; got {by!r}")
    rank, world = _distributed.setup()
    shape = tuple(results.maps.shape[1:])
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for _, arrays in results.shards(rank, world, fields=("maps", by)):
        labels_all = torch.from_numpy(np.array(arrays[by][:, 0] if by == "classes" else arrays[by]))
        for start in range(0, len(labels_all), _CHUNK):
            labels = labels_all[start : start + _CHUNK]
            maps = torch.from_numpy(np.array(arrays["maps"][start : start + _CHUNK])).double()
            for cls in labels.unique().tolist():
                if cls < 0:
                    continue
                chosen = labels == cls
                sums[cls] = sums.get(cls, torch.zeros(shape, dtype=torch.float64)) + maps[chosen].sum(dim=0)
                counts[cls] = counts.get(cls, 0) + int(chosen.sum())
    size = _distributed.all_max(max(sums, default=-1)) + 1
    total = torch.zeros((size, *shape), dtype=torch.float64)
    number = torch.zeros(size, dtype=torch.int64)
    for cls, value in sums.items():
        total[cls] = value
        number[cls] = counts[cls]
    total, number = _distributed.all_sum(total), _distributed.all_sum(number)
    present = (number > 0).nonzero()[:, 0]
    shaped = number[present].view(-1, *([1] * len(shape)))
    return ClassMeans(classes=present, means=total[present] / shaped, counts=number[present])


@dataclass(frozen=True)
class PatchingMean:
    """A patching result averaged over a dataset of input pairs.

    Attributes:
        mean: the mean over pairs of the per-pair results (same shape as one result), float64.
        std: their standard deviation (``n - 1`` in the denominator; zero for a single pair), float64.
        count: the number of pairs.
    """

    mean: torch.Tensor
    std: torch.Tensor
    count: int


Patching = Callable[..., torch.Tensor]


def mean_patching(
    model: nn.Module,
    pairs: Sequence[Any],
    layers: Any,
    metric: Callable[[Any], torch.Tensor],
    *,
    patching: Patching = activation_patching,
    progress: bool = True,
    **options: Any,
) -> PatchingMean:
    """Average ``patching(model, clean, corrupted, layers, metric, **options)`` over a dataset of pairs.

    Each process runs its share of the pairs (pair ``i`` on rank ``i % world_size``) and the sums are combined
    with collectives; every process gets the result. Any function with the signature of
    :func:`~attribution.activation_patching` can be given as ``patching`` (an attribution-patching estimate, say).

    Args:
        model: the model.
        pairs: a sequence (or map-style dataset) of ``(clean, corrupted)`` input pairs, or of dicts with ``"clean"``
            and ``"corrupted"`` entries; each input as the patching function takes it (with its batch axis).
        layers: the layers to patch, as for :func:`~attribution.activation_patching`.
        metric: ``metric(model_output)`` -> a scalar, as for :func:`~attribution.activation_patching`.
        patching: the patching function (default :func:`~attribution.activation_patching`).
        progress: show a tqdm progress bar on a terminal over the pairs (on rank 0); the patching function's own bar
            is turned off when it has a ``progress`` parameter.
        **options: passed to ``patching`` (``positions=``, ``site=``, ``heads=``, ``normalize=``, ...).

    Returns:
        :class:`PatchingMean`: mean and standard deviation over the pairs, and their number.

    Raises:
        ValueError: ``pairs`` is empty, a pair is malformed, or the results of two pairs differ in shape (prompts of
            different lengths with ``positions=True``: pad them, or use ``positions=False``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> pairs = [(torch.randn(1, 3, 4), torch.randn(1, 3, 4)) for _ in range(5)]
        >>> result = mean_patching(model, pairs, ["0", "1"], lambda out: out[:, -1].mean(), progress=False)
        >>> result.mean.shape, result.count
        (torch.Size([2, 3]), 5)
    """
    if len(pairs) == 0:
        raise ValueError("`pairs` is empty")
    rank, world = _distributed.setup()
    if "progress" in inspect.signature(patching).parameters:
        options = {"progress": False, **options}
    total: torch.Tensor | None = None
    squares: torch.Tensor | None = None
    first: tuple[int, tuple[int, ...]] | None = None
    mine = _distributed.share(len(pairs), rank, world)
    for i in progress_bar(mine, desc="mean_patching", enabled=progress and rank == 0, leave=True, dynamic_ncols=True):
        clean, corrupted = _pair(pairs[i], i)
        result = patching(model, clean, corrupted, layers, metric, **options).detach().double().cpu()
        if first is None:
            first = (i, tuple(result.shape))
        elif tuple(result.shape) != first[1]:
            raise ValueError(_shape_message(first, (i, tuple(result.shape))))
        total = result if total is None else total + result
        squares = result.square() if squares is None else squares + result.square()
    shapes = [s for s in _distributed.all_gather(first) if s is not None]
    for other in shapes[1:]:
        if other[1] != shapes[0][1]:
            raise ValueError(_shape_message(shapes[0], other))
    shape = shapes[0][1]
    total = _distributed.all_sum(total if total is not None else torch.zeros(shape, dtype=torch.float64))
    squares = _distributed.all_sum(squares if squares is not None else torch.zeros(shape, dtype=torch.float64))
    n = len(pairs)
    mean = total / n
    variance = (squares - n * mean.square()).clamp(min=0) / max(n - 1, 1)
    return PatchingMean(mean=mean, std=variance.sqrt(), count=n)


def _pair(item: Any, i: int) -> tuple[Any, Any]:
    if isinstance(item, Mapping) and "clean" in item and "corrupted" in item:
        return item["clean"], item["corrupted"]
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise ValueError(
        f"pair {i} must be (clean, corrupted) or a dict with 'clean' and 'corrupted'; got {type(item).__name__}"
        + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
    )


def _shape_message(a: tuple[int, tuple[int, ...]], b: tuple[int, tuple[int, ...]]) -> str:
    return (
        f"pair {b[0]} gives a result of shape {b[1]} but pair {a[0]} gave {a[1]}: results must have one shape to be "
        "averaged (prompts of different lengths with positions=True? pad them to one length, or pass "
        "positions=False)"
    )
