"""Run a model on batches of perturbed images and read the target's score: the part every perturbation metric shares.

This is the only module of :mod:`attribution.metrics` that knows how targets are resolved.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .._guard import evaluating
from .._targets import Target, check_target, class_indices, class_logits, target_scores

SCORES = ("probability", "logit")


@contextmanager
def observing(model: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the body; every module's flag and the grad mode restored after, whatever happens.

    Nothing is registered on the model, and parameters, buffers and ``.grad`` cannot change: without autograd
    nothing accumulates, and in eval mode batch norm does not update its running statistics.
    """
    with evaluating(model), torch.no_grad():
        yield


def check_images(inputs: Any, maps: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs`` as ``(B, C, H, W)`` and ``maps`` as ``(B, H, W)``, checked against each other.

    A single image ``(C, H, W)`` with its map ``(H, W)`` becomes a batch of one.
    """
    if not isinstance(inputs, torch.Tensor) or not isinstance(maps, torch.Tensor):
        raise TypeError(f"`inputs` and `maps` must be tensors; got {type(inputs).__name__} and {type(maps).__name__}")
    if inputs.dim() == 3 and maps.dim() == 2:
        inputs, maps = inputs[None], maps[None]
    if inputs.dim() != 4 or maps.dim() != 3 or maps.shape != (inputs.shape[0], *inputs.shape[2:]):
        hint = ""
        if maps.dim() == 4 and maps.shape[1] == 1:
            hint = "; drop the channel axis with maps[:, 0]"
        elif maps.dim() == 3 and inputs.dim() == 4 and maps.shape[0] == inputs.shape[0]:
            hint = (
                "; upsample the maps to the input size, e.g. with torch.nn.functional.interpolate(maps[:, None], "
                "size=inputs.shape[-2:], mode='bilinear')[:, 0] (CAMs do so unless upsample=False)"
            )
        raise ValueError(
            f"`maps` must be (B, H, W) for `inputs` (B, C, H, W), one map per image at the input's size; got "
            f"maps {tuple(maps.shape)} for inputs {tuple(inputs.shape)}{hint}"
        )
    if not inputs.is_floating_point():
        raise TypeError(f"`inputs` must be floating-point model inputs; got {inputs.dtype}")
    if not maps.is_floating_point():
        maps = maps.float()
    if not torch.isfinite(maps).all():
        raise ValueError("`maps` contain NaN or infinite values; the pixels cannot be ranked")
    flat = maps.flatten(1)
    constant = (flat == flat[:, :1]).all(dim=1).nonzero().flatten().tolist()
    if constant:
        warnings.warn(
            f"the map of item(s) {constant} is constant (e.g. all zero): its pixels have no order, so they are "
            "perturbed in raster order and the result says nothing about the method",
            stacklevel=3,
        )
    return inputs, maps.to(inputs.device)


class Scorer:
    """The target's score ``(n,)`` for any batch of perturbed images, its classes fixed on the unperturbed ones.

    ``None`` takes each image's top class on the unperturbed input, an int or a sequence of ints fixes the classes;
    the score is then the class's softmax probability (``score="probability"``) or its logit (``"logit"``). A
    callable target gets the model output of each batch and returns one score per row itself (``score`` does not
    apply): it must score rows independently, since a batch mixes perturbed copies of several images.
    """

    def __init__(self, model: nn.Module, target: Target, score: str, batch: int) -> None:
        if score not in SCORES:
            raise ValueError(f"`score` must be 'probability' or 'logit'; got {score!r}")
        check_target(target, batch)
        self.model, self.target, self.score, self.batch = model, target, score, batch
        self.classes: torch.Tensor | None = None

    def __call__(self, images: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Scores of ``images`` ``(n, C, H, W)``, perturbed copies of the images ``items`` ``(n,)``."""
        return self._read(self.model(images), items)

    def unperturbed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Scores of the unperturbed ``inputs``, which fix the classes of a ``None`` target."""
        output = self.model(inputs)
        if not callable(self.target):
            self.classes = class_indices(class_logits(output), self.target, self.batch)
        return self._read(output, torch.arange(len(inputs)))

    def _read(self, output: Any, items: torch.Tensor) -> torch.Tensor:
        if callable(self.target):
            return _floating(target_scores(output, self.target, len(items)))
        logits = _floating(class_logits(output))
        if self.score == "probability":
            logits = logits.softmax(dim=1)
        assert self.classes is not None, "score the unperturbed images first"
        return logits.gather(1, self.classes[items.to(self.classes.device)][:, None]).squeeze(1)


def run_batches(
    scorer: Scorer,
    count: int,
    make: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    *,
    progress: bool = False,
    desc: str = "",
) -> torch.Tensor:
    """Scores ``(count,)`` of ``count`` perturbed inputs, built and run ``batch_size`` at a time.

    ``make(jobs)`` gets a range of job numbers ``(n,)`` and returns the perturbed images ``(n, C, H, W)`` and the
    image each one was made of ``(n,)``.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}")
    scores = []
    for start in tqdm(range(0, count, batch_size), desc=desc, disable=not progress, leave=False):
        images, items = make(torch.arange(start, min(start + batch_size, count)))
        scores.append(scorer(images, items).detach().cpu())
    return torch.cat(scores) if scores else torch.empty(0)


def _floating(scores: torch.Tensor) -> torch.Tensor:
    """Scores in float32 at least (float64 stays float64)."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def top_classes(model: nn.Module, inputs: torch.Tensor) -> list[int]:
    """Each image's top class on ``model`` as it is (one forward in eval mode, without autograd)."""
    with observing(model):
        logits = class_logits(model(inputs))
    return class_indices(logits, None, logits.shape[0]).tolist()
