"""What to explain: the ``target=`` of every attribution method, and ready-made target callables.

A target turns the model's output into one score per batch item, ``(batch,)``; the methods explain that score.
``target=`` accepts:

* ``None``: each item's top class (the argmax of its logits);
* an integer (Python, numpy or a 0-d tensor): that class for every item;
* a sequence, numpy array or 1-D tensor of integers: one class per item;
* a callable ``output -> (batch,)`` scores, such as the classes of this module: :class:`ClassLogit` for
  classifiers, :class:`Segmentation` for segmentation models and :class:`Detection` for torchvision detectors.

Class scores are logits, before any softmax, read from a ``(batch, classes)`` output or an output's ``logits``
(HuggingFace ``ModelOutput``).

Example:
    >>> import torch
    >>> from attribution import targets
    >>> logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    >>> targets.ClassLogit([1, 2])(logits)
    tensor([2., 1.])
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch

from ._run import warn

__all__ = ["ClassLogit", "Detection", "Segmentation", "Target"]

Target = Union[  # noqa: UP007 (a runtime alias: `|` on these types needs Python 3.10 typing objects everywhere)
    None, int, np.integer, Sequence[int], np.ndarray, torch.Tensor, Callable[[Any], torch.Tensor]
]
"""The type of the ``target=`` argument: ``None``, integer class(es), or a callable ``output -> (batch,)``."""


# -- the classes --------------------------------------------------------------------------------------------------
class ClassLogit:
    """The logit of a class: ``output[b, classes[b]]`` of ``(batch, classes)`` logits or of ``output.logits``.

    Args:
        classes: one class for every item (an integer), or one per item (a sequence, array or 1-D tensor).

    Example:
        >>> ClassLogit(0)(torch.tensor([[1.5, 0.0], [2.5, 1.0]]))
        tensor([1.5000, 2.5000])
    """

    def __init__(self, classes: int | Sequence[int] | np.ndarray | torch.Tensor) -> None:
        self.classes = target_indices(classes, "`classes`")
        if self.classes is None:
            raise TypeError("`classes` must be an integer or integers, one per item; got None")

    def __call__(self, output: Any) -> torch.Tensor:
        """The ``(batch,)`` logits of the classes."""
        logits = class_logits(output)
        return logits.gather(1, class_indices(logits, self.classes, logits.shape[0])[:, None]).squeeze(1)

    def __repr__(self) -> str:
        return f"ClassLogit({self.classes.tolist() if self.classes is not None else None})"


class Segmentation:
    """The summed logits of a category over a region, per image, for segmentation models.

    Reads torchvision's ``{"out": (batch, classes, H, W)}``, a plain ``(batch, classes, H, W)`` tensor, or an
    output's ``logits`` (HuggingFace). The score of item ``b`` is ``sum_ij out[b, category, i, j] * mask[b, i, j]``,
    with ``mask=None`` meaning the pixels whose predicted class (the argmax over classes) is ``category``. An item
    with no such pixel gets score 0, and its map is all zeros (the methods warn about it).

    Args:
        category: the category, one for all images or one per image.
        mask: ``(H, W)`` for every image or ``(batch, H, W)``, boolean or float weights, of the output's size.

    Example:
        >>> out = {"out": torch.zeros(2, 3, 4, 4)}
        >>> out["out"][:, 1, :2] = 1.0                       # category 1 wins in the top half
        >>> Segmentation(1)(out)                             # 8 pixels of logit 1 each
        tensor([8., 8.])
    """

    def __init__(
        self,
        category: int | Sequence[int] | np.ndarray | torch.Tensor,
        mask: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        self.category = target_indices(category, "`category`")
        if self.category is None:
            raise TypeError("`category` must be an integer or integers, one per image; got None")
        self.mask = None if mask is None else torch.as_tensor(mask)

    def __call__(self, output: Any) -> torch.Tensor:
        """The ``(batch,)`` scores."""
        logits = _segmentation_logits(output)
        b, _, h, w = logits.shape
        category = class_indices(logits.flatten(2).mean(2), self.category, b)
        chosen = logits[torch.arange(b, device=logits.device), category]  # (b, h, w)
        if self.mask is None:
            weights = (logits.detach().argmax(1) == category[:, None, None]).to(chosen.dtype)
        else:
            mask = self.mask.to(device=chosen.device, dtype=chosen.dtype)
            if tuple(mask.shape[-2:]) != (h, w) or mask.dim() not in (2, 3) or (mask.dim() == 3 and len(mask) != b):
                raise ValueError(
                    f"`mask` must be (H, W) or (batch, H, W) of the output's size, ({b}, {h}, {w}); got "
                    f"{tuple(mask.shape)}"
                )
            weights = mask
        return (chosen * weights).flatten(1).sum(1)

    def __repr__(self) -> str:
        mask = "None" if self.mask is None else f"<mask {tuple(self.mask.shape)}>"
        return f"Segmentation({self.category.tolist() if self.category is not None else None}, mask={mask})"


class Detection:
    """The score of the detected box that best matches each box to explain, for torchvision detection models.

    A torchvision detector returns, per image, a dict with ``boxes`` ``(N, 4)`` (``x1, y1, x2, y2``), ``labels``
    ``(N,)`` and ``scores`` ``(N,)``. For each box to explain in image ``i`` (``labels[i][j]``, ``boxes[i][j]``),
    the detections of the same label whose IoU with it is at least ``iou`` are candidates, and the score of the one
    with the highest IoU counts; the item's score is the sum over its boxes. This is pytorch-grad-cam's
    ``FasterRCNNBoxScoreTarget`` without its IoU term (the IoU is not added to the score). A box with no candidate
    adds 0, with a warning.

    Args:
        labels: per image, the labels of the boxes to explain (a sequence of integer sequences or 1-D tensors).
        boxes: per image, the ``(N_i, 4)`` boxes to explain, in the input image's pixel coordinates.
        iou: the least IoU a detection needs to match a box.

    Example:
        >>> out = [{"boxes": torch.tensor([[0.0, 0, 10, 10], [5, 5, 20, 20]]), "labels": torch.tensor([3, 3]),
        ...         "scores": torch.tensor([0.9, 0.6])}]
        >>> Detection([[3]], [torch.tensor([[4.0, 4, 20, 20]])])(out)   # the second box overlaps best
        tensor([0.6000])
    """

    def __init__(
        self,
        labels: Sequence[Sequence[int] | torch.Tensor | np.ndarray],
        boxes: Sequence[torch.Tensor | np.ndarray | Sequence[Sequence[float]]],
        iou: float = 0.5,
    ) -> None:
        if isinstance(labels, torch.Tensor | np.ndarray) or isinstance(boxes, torch.Tensor | np.ndarray):
            raise TypeError(
                "`labels` and `boxes` are per image: a list with, for image i, the labels (N_i,) and the boxes "
                "(N_i, 4) to explain, e.g. Detection([[3]], [[[10, 20, 80, 90]]])"
            )
        if len(labels) != len(boxes):
            raise ValueError(f"`labels` has {len(labels)} images but `boxes` has {len(boxes)}; give both per image")
        self.labels = [torch.as_tensor(lab, dtype=torch.long).reshape(-1) for lab in labels]
        self.boxes = [torch.as_tensor(box, dtype=torch.float32).reshape(-1, 4) for box in boxes]
        for i, (lab, box) in enumerate(zip(self.labels, self.boxes, strict=True)):
            if len(lab) != len(box):
                raise ValueError(f"image {i}: {len(lab)} labels but {len(box)} boxes; give one label per box")
        if not 0 <= iou <= 1:
            raise ValueError(f"`iou` must be in [0, 1]; got {iou}")
        self.iou = iou

    def __call__(self, output: Any) -> torch.Tensor:
        """The ``(batch,)`` scores."""
        if not (isinstance(output, Sequence) and all(isinstance(o, Mapping) and "scores" in o for o in output)):
            raise TypeError(
                "Detection reads torchvision detection outputs: a list with one dict (boxes, labels, scores) per "
                f"image; got {type(output).__name__}"
            )
        if len(output) != len(self.labels):
            raise ValueError(f"the model returned {len(output)} images but the target has {len(self.labels)}")

        from torchvision.ops import box_iou

        scores = []
        for i, (found, labels, boxes) in enumerate(zip(output, self.labels, self.boxes, strict=True)):
            total = found["scores"].sum() * 0  # keeps the graph and the dtype when nothing matches
            for label, box in zip(labels.tolist(), boxes.to(found["boxes"].device), strict=True):
                same = found["labels"] == label
                overlap = box_iou(box[None], found["boxes"].detach())[0]
                overlap = torch.where(same & (overlap >= self.iou), overlap, -1)
                if len(overlap) == 0 or overlap.max() < 0:
                    warn(
                        f"image {i}: no detection of label {label} has IoU >= {self.iou} with box "
                        f"{[round(v, 1) for v in box.tolist()]}; it adds 0 to the score (lower `iou`, or check the "
                        "box's coordinates: pixels of the input image, x1, y1, x2, y2)",
                    )
                    continue
                total = total + found["scores"][overlap.argmax()]
            scores.append(total)
        return torch.stack(scores)

    def __repr__(self) -> str:
        return f"Detection({[lab.tolist() for lab in self.labels]}, <boxes>, iou={self.iou})"


# -- used by the methods ------------------------------------------------------------------------------------------
def target_indices(target: Any, what: str) -> torch.Tensor | None:
    """Integer class(es) as a 0-d or 1-D long tensor (``None`` stays ``None``); anything else is a ``TypeError``.

    Args:
        target: ``None``, an integer, or integers (a sequence, numpy array or 1-D tensor).
        what: the argument's name in the error message, e.g. ``"`target`"``.

    Example:
        >>> target_indices([2, 0], "`target`"), target_indices(3, "`target`")
        (tensor([2, 0]), tensor(3))
    """
    if target is None:
        return None
    if isinstance(target, bool) or isinstance(target, np.bool_):
        raise TypeError(f"{what} must be integer class indices; got a bool ({target})")
    if isinstance(target, numbers.Integral):
        return torch.tensor(int(target))
    if isinstance(target, torch.Tensor | np.ndarray) or (
        isinstance(target, Sequence) and not isinstance(target, str | bytes)
    ):
        try:
            index = torch.as_tensor(np.asarray(target) if isinstance(target, Sequence) else target)
        except (TypeError, ValueError, RuntimeError):
            index = None
        if index is not None and index.dim() <= 1 and not index.is_floating_point() and index.dtype != torch.bool:
            if index.is_complex():
                index = None
            else:
                return index.long()
        shape = f" of shape {tuple(index.shape)} ({index.dtype})" if index is not None else ""
        raise TypeError(f"{what} must hold integer class indices, one per item; got {type(target).__name__}{shape}")
    raise TypeError(
        f"{what} must be None (each item's top class), an integer, integers (one per item: a list, numpy array or "
        f"1-D tensor) or a callable output -> (batch,) scores; got {type(target).__name__}"
    )


def check_target(target: Target, batch: int) -> None:
    """Reject a target of the wrong kind or length before any forward runs."""
    if target is None or callable(target):
        return
    index = target_indices(target, "`target`")
    if index is not None and index.dim() == 1 and len(index) != batch:
        raise ValueError(f"`target` has {len(index)} entries but the batch has {batch} items; give one class per item")


def target_scores(output: Any, target: Target, batch: int) -> torch.Tensor:
    """Scores ``(batch,)`` of the model output to explain (see the module documentation)."""
    if callable(target):
        scores = target(output)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (batch,):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"a callable `target` must return scores of shape ({batch},), one per item; got {got}")
        return scores
    logits = class_logits(output)
    return logits.gather(1, class_indices(logits, target, batch)[:, None]).squeeze(1)


def class_logits(output: Any) -> torch.Tensor:
    """The ``(batch, classes)`` logits of a model output (a tensor, or an object with a ``logits`` tensor)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, Mapping) and "logits" in logits:
        logits = logits["logits"]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"an integer or None `target` needs model outputs of shape (batch, classes); got {shape}. Pass a "
            "callable target instead: attribution.targets.Segmentation(category) for segmentation, "
            "attribution.targets.Detection(labels, boxes) for torchvision detectors, or your own output -> (batch,) "
            "function"
        )
    return logits


def class_indices(logits: torch.Tensor, target: Any, batch: int) -> torch.Tensor:
    """The class of each item: ``target`` as a ``(batch,)`` index tensor (the top class for ``None``), checked."""
    classes = logits.shape[1]
    if target is None:
        return logits.detach().argmax(dim=1)
    index = target if isinstance(target, torch.Tensor) else target_indices(target, "`target`")
    assert index is not None
    index = index.to(logits.device).long().expand(batch)
    bad = index[(index < 0) | (index >= classes)]
    if bad.numel():
        raise ValueError(
            f"`target` class {bad[0].item()} is out of range: the model has {classes} classes (0..{classes - 1})"
        )
    return index


def _segmentation_logits(output: Any) -> torch.Tensor:
    """The ``(batch, classes, H, W)`` logits of a segmentation output."""
    logits = output
    if isinstance(output, Mapping):
        key = "out" if "out" in output else "logits" if "logits" in output else None
        if key is None:
            raise ValueError(
                f"Segmentation reads the 'out' (torchvision) or 'logits' entry of a dict output; got keys "
                f"{list(output)}"
            )
        logits = output[key]
    elif not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 4:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"Segmentation needs logits (batch, classes, H, W); got {got}")
    return logits
