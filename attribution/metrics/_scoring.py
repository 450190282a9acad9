"""Run a model on batches of perturbed images and read the target's score: the part every perturbation metric shares.

Deletion, insertion and ROAD score through here, and only here learn how inputs are passed and how targets are
resolved; the randomisation test reads the top classes here and calls the user's method itself.

Perturbed copies are numbered point-major, ``job = point * B + item``, so that every ``B`` consecutive jobs hold one
copy of each image in batch order. A callable target is given the output of such a group of ``B`` rows, exactly as a
CAM gives it the output of the unperturbed batch: targets that hold one class, category or mask per item
(``targets.ClassLogit([3, 7])``, ``targets.Segmentation(1, mask=...)``) score the right rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hooks import map_tensors

from .._inputs import batched, call, describe, find_images, is_image_list
from .._maps import at_least_float32
from .._progress import progress as progress_bar
from .._run import kept_state, warn
from ..targets import Target, check_target, class_indices, class_logits, target_scores
from ._similarity import constant_items

SCORES = ("probability", "logit")


@contextmanager
def observing(model: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the body; the model's state restored after, whatever happens.

    Nothing is registered on the model; every module's train/eval flag, the grad mode, ``requires_grad`` and
    ``.grad`` are put back (``attribution._run.kept_state``). Parameters and buffers cannot change: without autograd
    nothing accumulates, and in eval mode batch norm does not update its running statistics.
    """
    with kept_state(model), torch.no_grad():
        yield


class Images:
    """The images ``(B, C, H, W)`` inside model inputs of any form the CAMs take, and the inputs rebuilt around copies.

    ``inputs`` is an image tensor ``(B, C, H, W)`` (or one image ``(C, H, W)``), a mapping of keyword inputs whose
    ``pixel_values`` are the images (a HuggingFace ``BatchFeature``), or a tuple of positional inputs whose first
    4-D floating-point tensor is the images. Around a perturbed copy of image ``i``, the other entries are kept, and
    those that are tensors with a first axis of ``B`` are taken at row ``i``.
    """

    def __init__(self, inputs: Any, model: nn.Module) -> None:
        if is_image_list(inputs):
            raise TypeError(
                "the perturbation metrics need the images as one tensor (B, C, H, W): a list of images (torchvision "
                "detection models) cannot be perturbed as a batch and scored per copy"
            )
        given = batched(inputs, model, images=True)
        self.inputs, self.single = given.inputs, given.single
        self.key, found = find_images(self.inputs)
        if not isinstance(found, torch.Tensor) or found.dim() != 4:
            raise TypeError(
                "`inputs` must hold images to perturb: a tensor (B, C, H, W) or one image (C, H, W), a mapping with "
                f"pixel_values (B, C, H, W), or a tuple with one (B, C, H, W) tensor; got {describe(inputs)}"
            )
        if not found.is_floating_point():
            raise TypeError(
                f"`inputs` must be floating-point images; got {found.dtype}: convert with `images.float() / 255` "
                "(then normalise them as the model was trained)"
            )
        if found.shape[0] == 0:
            raise ValueError(f"`inputs` is an empty batch {tuple(found.shape)}: pass at least one image")
        self.pixels = found

    def __len__(self) -> int:
        return len(self.pixels)

    def model_inputs(self, images: torch.Tensor, items: torch.Tensor) -> Any:
        """The model's inputs with ``images`` ``(n, C, H, W)``, copies of the images ``items`` ``(n,)``."""
        if self.key is None:
            return images
        batch = len(self.pixels)

        def rows(value: Any) -> Any:
            per_item = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
            return value[items.to(value.device)] if per_item else value

        if isinstance(self.inputs, Mapping):
            return {k: images if k == self.key else rows(v) for k, v in self.inputs.items()}
        return tuple(images if i == self.key else rows(v) for i, v in enumerate(self.inputs))

    def maps(self, maps: Any) -> torch.Tensor:
        """``maps`` as ``(B, H, W)``, checked against the images (one map ``(H, W)`` goes with one image)."""
        if not isinstance(maps, torch.Tensor):
            raise TypeError(f"`maps` must be a tensor (B, H, W); got {type(maps).__name__}")
        pixels = self.pixels
        if self.single and maps.dim() == 2:
            maps = maps[None]
        if maps.dim() != 3 or maps.shape != (pixels.shape[0], *pixels.shape[2:]):
            hint = ""
            if maps.dim() == 4 and maps.shape[1] == 1:
                hint = "; drop the channel axis with maps[:, 0]"
            elif maps.dim() == 3 and maps.shape[0] == pixels.shape[0]:
                hint = (
                    "; upsample the maps to the input size, e.g. with torch.nn.functional.interpolate(maps[:, None], "
                    "size=inputs.shape[-2:], mode='bilinear')[:, 0] (CAMs do so unless upsample=False)"
                )
            raise ValueError(
                f"`maps` must be (B, H, W) for images (B, C, H, W), one map per image at the image's size; got maps "
                f"{tuple(maps.shape)} for images {tuple(pixels.shape)}{hint}"
            )
        if not maps.is_floating_point():
            maps = maps.float()
        if not torch.isfinite(maps).all():
            raise ValueError("`maps` contain NaN or infinite values; the pixels cannot be ranked")
        constant = constant_items(maps)
        if constant:
            warn(
                f"the map of item(s) {constant} is constant (e.g. all zero): its pixels have no order, so they are "
                "perturbed in raster order and the result says nothing about the method",
            )
        return maps.to(pixels.device)


class Scorer:
    """The target's score ``(n,)`` for any batch of perturbed images, its classes fixed on the unperturbed ones.

    ``None`` takes each image's top class on the unperturbed input, an int or integers one per image fix the
    classes; the score is then the class's softmax probability (``score="probability"``) or its logit (``"logit"``).
    A callable target gets the model output of each group of ``B`` perturbed copies, one of each image in batch
    order, and its scores are used as they are (``score`` does not apply).
    """

    def __init__(self, model: nn.Module, images: Images, target: Target, score: str, batch_size: int) -> None:
        if score not in SCORES:
            raise ValueError(f"`score` must be 'probability' or 'logit'; got {score!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}")
        check_target(target, len(images))
        self.model, self.images, self.target, self.score = model, images, target, score
        group = len(images)  # a callable target is given whole groups of B copies (at least one group)
        self.chunk = max(group, batch_size // group * group) if callable(target) else batch_size
        self.classes: torch.Tensor | None = None

    def __call__(self, images: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Scores of ``images`` ``(n, C, H, W)``, perturbed copies of the images ``items`` ``(n,)``."""
        return self._read(call(self.model, self.images.model_inputs(images, items)), items)

    def unperturbed(self) -> torch.Tensor:
        """Scores of the unperturbed images, which fix the classes of a ``None`` target."""
        output = call(self.model, self.images.inputs)
        if not callable(self.target):
            self.classes = class_indices(class_logits(output), self.target, len(self.images))
        scores = self._read(output, torch.arange(len(self.images)))
        bad = (~torch.isfinite(scores.detach())).nonzero().flatten().tolist()
        if bad:
            warn(
                f"the unperturbed images of item(s) {bad} score NaN or inf (a NaN/inf pixel, or the model's "
                "numerics): their curves are NaN and say nothing about the map. Check torch.isfinite(images)"
            )
        return scores

    def _read(self, output: Any, items: torch.Tensor) -> torch.Tensor:
        if callable(self.target):
            group, rows = len(self.images), len(items)
            if rows == group:
                return at_least_float32(target_scores(output, self.target, group))
            assert rows % group == 0, "run_batches gives whole groups"
            assert bool((items.view(-1, group) == torch.arange(group, device=items.device)).all()), "in batch order"
            parts = [_rows(output, start, start + group, rows) for start in range(0, rows, group)]
            return torch.cat([at_least_float32(target_scores(part, self.target, group)) for part in parts])
        logits = at_least_float32(class_logits(output))
        if self.score == "probability":
            logits = logits.softmax(dim=1)
        assert self.classes is not None, "score the unperturbed images first"
        return logits.gather(1, self.classes[items.to(self.classes.device)][:, None]).squeeze(1)


def _rows(output: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of a model output: every tensor in it with ``rows`` rows is sliced, containers kept."""

    def part(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[start:stop]
        return value

    return map_tensors(part, output)


def run_batches(
    scorer: Scorer,
    count: int,
    make: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    progress: bool = False,
    desc: str = "",
) -> torch.Tensor:
    """Scores ``(count,)`` of ``count`` perturbed inputs, built and run ``scorer.chunk`` at a time.

    ``make(jobs)`` gets a range of job numbers ``(n,)`` and returns the perturbed images ``(n, C, H, W)`` and the
    image each one was made of ``(n,)``.
    """
    scores = []
    for start in progress_bar(range(0, count, scorer.chunk), desc=desc, enabled=progress):
        images, items = make(torch.arange(start, min(start + scorer.chunk, count)))
        scores.append(scorer(images, items).detach().cpu())
    return torch.cat(scores) if scores else torch.empty(0)


def top_classes(model: nn.Module, inputs: Any) -> list[int]:
    """Each item's top class on ``model`` as it is (one forward in eval mode, without autograd)."""
    with observing(model):
        logits = class_logits(call(model, batched(inputs, model, images=True).inputs))
    return class_indices(logits, None, logits.shape[0]).tolist()
