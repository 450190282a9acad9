"""What to explain: turn a ``target`` (None, int, sequence of ints, callable) into one score per batch item."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

Target = Union[None, int, Sequence[int], torch.Tensor, Callable[[Any], torch.Tensor]]  # noqa: UP007


def check_target(target: Target, batch: int) -> None:
    """Reject a target of the wrong kind or length before any forward runs."""
    if target is None or callable(target) or isinstance(target, int):
        return
    if isinstance(target, torch.Tensor):
        if target.dim() == 0:
            return
        if target.dim() != 1 or target.dtype.is_floating_point:
            raise TypeError(
                f"`target` as a tensor must hold integer class indices, shape ({batch},); got {target.dtype} "
                f"of shape {tuple(target.shape)}"
            )
    elif not isinstance(target, Sequence) or not all(isinstance(t, int) for t in target):
        raise TypeError(
            "`target` must be None (each item's top class), an int, a sequence of ints (one per item) or a callable "
            f"output -> (batch,) scores; got {type(target).__name__}"
        )
    if len(target) != batch:
        raise ValueError(f"`target` has {len(target)} entries but the batch has {batch} items; give one class per item")


def target_scores(output: Any, target: Target, batch: int) -> torch.Tensor:
    """Scores ``(batch,)`` of the model output to explain.

    ``None`` takes each item's top class, an int the same class for all items, a sequence one class per item (all on
    the logits ``output[b, class]``, before any softmax); a callable gets the model output and returns the scores
    itself (segmentation, detection, regression, a custom objective).
    """
    if callable(target):
        scores = target(output)
        if not isinstance(scores, torch.Tensor) or scores.shape != (batch,):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"a callable `target` must return scores of shape ({batch},), one per item; got {got}")
        return scores
    logits = class_logits(output)
    return logits.gather(1, class_indices(logits, target, batch)[:, None]).squeeze(1)


def class_logits(output: Any) -> torch.Tensor:
    """The ``(batch, classes)`` logits of a model output (a tensor, or an object with a ``logits`` tensor)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"an int or None `target` needs model outputs of shape (batch, classes); got {shape}. Pass a callable "
            "target instead, e.g. target=lambda out: out['logits'][:, 3] or lambda out: out[:, 1].mean((1, 2))"
        )
    return logits


def class_indices(logits: torch.Tensor, target: Target, batch: int) -> torch.Tensor:
    """The class of each item: ``target`` as a ``(batch,)`` index tensor (the top class for ``None``), checked."""
    classes = logits.shape[1]
    if target is None:
        return logits.detach().argmax(dim=1)
    index = torch.as_tensor(target, device=logits.device).long().expand(batch)
    bad = index[(index < 0) | (index >= classes)]
    if bad.numel():
        raise ValueError(
            f"`target` class {bad[0].item()} is out of range: the model has {classes} classes (0..{classes - 1})"
        )
    return index
