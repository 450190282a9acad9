"""Deletion and insertion (Petsiuk et al., 2018, RISE): the target's score as the most salient pixels go, or come."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._perturb import Baseline, auc, make_baseline, pixel_ranks, replace_top, step_counts
from ._scoring import Images, Scorer, Target, observing, run_batches


@dataclass(frozen=True)
class CurveResult:
    """A deletion or insertion curve per image, and the area under it.

    Attributes:
        kind: ``"deletion"`` or ``"insertion"``.
        fractions: ``(steps + 1,)`` share of the pixels removed (deletion) or revealed (insertion) at each point,
            from 0 to 1.
        scores: ``(B, steps + 1)`` the target's score at each point; deletion starts from the unperturbed image,
            insertion ends with it.
        auc: ``(B,)`` area under each curve over ``fractions`` (trapezoid rule), in [0, 1] for probabilities.
            Lower is better for deletion, higher for insertion.
    """

    kind: str
    fractions: torch.Tensor
    scores: torch.Tensor
    auc: torch.Tensor


def deletion(
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target = None,
    *,
    baseline: Baseline = "zeros",
    steps: int = 50,
    score: str = "probability",
    batch_size: int = 32,
    progress: bool = False,
) -> CurveResult:
    """Deletion curve (RISE, https://arxiv.org/abs/1806.07421): the score as the most salient pixels are removed.

    At point ``k = 0..steps`` the ``floor(k * H * W / steps)`` pixels ranked highest by the map (all channels of a
    pixel together; ties in raster order) are replaced by the ``baseline``'s values and the target's score is read.
    A faithful map makes the score fall fast: a low area under the curve is better.

    Args:
        model: the classifier; run in eval mode without autograd, left exactly as it was.
        inputs: ``(B, C, H, W)`` images as the model takes them (or one ``(C, H, W)`` image), or model inputs that
            hold them, as the CAMs take them: a mapping whose ``pixel_values`` are the images (``model(**inputs)``,
            a HuggingFace ``BatchFeature``) or a tuple of positional inputs whose first 4-D tensor is the images
            (``model(*inputs)``); other entries with a first axis of ``B`` go with their image.
        maps: ``(B, H, W)`` saliency maps at the input's size (or one ``(H, W)`` map), higher meaning more salient.
        target: whose score, in the forms of the CAMs: ``None`` (each image's top class on the unperturbed input),
            an int, one int per image, or a callable ``output -> (B,)`` such as :class:`attribution.targets.ClassLogit`
            (given the output of ``B`` perturbed copies at a time, one of each image in batch order).
        baseline: what removed pixels become: ``"zeros"`` (RISE's choice for deletion: the mean colour of a
            normalised dataset), ``"mean"`` (each image's channel means), ``"blur"`` (Gaussian, kernel 11, sigma 5),
            a tensor broadcastable to ``inputs``, or a callable ``inputs -> tensor``.
        steps: number of equal steps from no pixel to all pixels; the curve has ``steps + 1`` points and costs
            ``steps`` perturbed forwards per image (plus one unperturbed).
        score: for class targets, the class's softmax ``"probability"`` (RISE) or its ``"logit"``.
        batch_size: perturbed images per forward.
        progress: show a progress bar.

    Returns:
        :class:`CurveResult` with ``kind="deletion"``.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4)).eval()
        >>> result = deletion(model, torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8), steps=4)
        >>> result.scores.shape, result.auc.shape
        (torch.Size([2, 5]), torch.Size([2]))
    """
    return _curve("deletion", model, inputs, maps, target, baseline, steps, score, batch_size, progress)


def insertion(
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target = None,
    *,
    baseline: Baseline = "blur",
    steps: int = 50,
    score: str = "probability",
    batch_size: int = 32,
    progress: bool = False,
) -> CurveResult:
    """Insertion curve (RISE, https://arxiv.org/abs/1806.07421): the score as the most salient pixels are revealed.

    Starts from the ``baseline`` (RISE: the blurred image) and at point ``k = 0..steps`` puts back the
    ``floor(k * H * W / steps)`` pixels ranked highest by the map. A faithful map makes the score rise fast: a high
    area under the curve is better. Same arguments as :func:`deletion`, whose default baseline differs.

    Returns:
        :class:`CurveResult` with ``kind="insertion"``.
    """
    return _curve("insertion", model, inputs, maps, target, baseline, steps, score, batch_size, progress)


def _curve(
    kind: str,
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target,
    baseline: Baseline,
    steps: int,
    score: str,
    batch_size: int,
    progress: bool,
) -> CurveResult:
    given = Images(inputs, model)
    images, maps = given.pixels, given.maps(maps)
    batch, pixels = images.shape[0], images.shape[-2] * images.shape[-1]
    counts = step_counts(pixels, steps)
    scorer = Scorer(model, given, target, score, batch_size)
    ranks = pixel_ranks(maps)
    perturbed = (counts[1:] if kind == "deletion" else counts[:-1]).to(images.device)
    with observing(model):
        fill = make_baseline(baseline, images)
        start, fill = (images, fill) if kind == "deletion" else (fill, images)

        def make(jobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            jobs = jobs.to(images.device)
            items = jobs % batch  # point-major: one copy of each image per group of `batch` jobs
            return replace_top(start, fill, ranks, items, perturbed[jobs // batch]), items

        unperturbed = scorer.unperturbed().cpu()[:, None]
        rest = run_batches(scorer, steps * batch, make, progress=progress, desc=kind).view(steps, batch).T
    scores = torch.cat([unperturbed, rest] if kind == "deletion" else [rest, unperturbed], dim=1)
    fractions = counts.to(scores.dtype) / pixels
    return CurveResult(kind, fractions, scores, auc(fractions, scores))
