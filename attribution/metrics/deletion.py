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
        progress: show a progress bar on a terminal (it appears once the call has run for a second).

    Returns:
        :class:`CurveResult` with ``kind="deletion"``.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4)).eval()
        >>> result = deletion(model, torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8), steps=4)
        >>> result.scores.shape, result.auc.shape
        (torch.Size([2, 5]), torch.Size([2]))
    """
    (result,) = _curves(["deletion"], [baseline], model, inputs, maps, target, steps, score, batch_size, progress)
    return result


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
    (result,) = _curves(["insertion"], [baseline], model, inputs, maps, target, steps, score, batch_size, progress)
    return result


def deletion_insertion(
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target = None,
    *,
    baselines: tuple[Baseline, Baseline] = ("zeros", "blur"),
    steps: int = 50,
    score: str = "probability",
    batch_size: int = 32,
    progress: bool = False,
) -> tuple[CurveResult, CurveResult]:
    """Deletion and insertion curves in one call, sharing the forwards the two have in common.

    The same curves as ``deletion(..., baseline=baselines[0])`` and ``insertion(..., baseline=baselines[1])``
    (equal up to the rounding of running an image in another batch), for fewer forwards: the unperturbed images
    run once instead of twice, and when both curves use the same baseline (the same string, or the same tensor or
    callable object) the all-baseline image, deletion's last point and insertion's first, runs once too. With one
    baseline an image costs ``2 * steps`` forwards, as in torchcam's ``DeletionInsertionMetric``; with two,
    ``2 * steps + 1``.

    Args:
        model: the classifier; run in eval mode without autograd, left exactly as it was.
        inputs: the images, in the forms of :func:`deletion`.
        maps: ``(B, H, W)`` saliency maps at the input's size (or one ``(H, W)`` map), higher meaning more salient.
        target: whose score, in the forms of :func:`deletion`.
        baselines: the deletion baseline and the insertion baseline, each in the forms of :func:`deletion`'s
            ``baseline`` (default: RISE's zeros and blur, the defaults of the two separate calls).
        steps: number of equal steps of each curve (see :func:`deletion`).
        score: for class targets, the class's softmax ``"probability"`` or its ``"logit"``.
        batch_size: perturbed images per forward.
        progress: show a progress bar on a terminal (it appears once the call has run for a second).

    Returns:
        The deletion and the insertion :class:`CurveResult`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4)).eval()
        >>> removed, revealed = deletion_insertion(
        ...     model, torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8), baselines=("zeros", "zeros"), steps=4
        ... )
        >>> bool(torch.equal(removed.scores[:, -1], revealed.scores[:, 0]))  # the all-zeros image, run once
        True
    """
    if not isinstance(baselines, (tuple, list)) or len(baselines) != 2:
        raise TypeError(f"`baselines` must be a pair (deletion's, insertion's); got {baselines!r}")
    deleted, inserted = _curves(
        ["deletion", "insertion"], list(baselines), model, inputs, maps, target, steps, score, batch_size, progress
    )
    return deleted, inserted


def _same(a: Baseline, b: Baseline) -> bool:
    """Whether two baselines give the same values: the same name, or the same object."""
    return a is b or (isinstance(a, str) and isinstance(b, str) and a == b)


def _curves(
    kinds: list[str],
    baselines: list[Baseline],
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target,
    steps: int,
    score: str,
    batch_size: int,
    progress: bool,
) -> list[CurveResult]:
    """The curves of ``kinds`` (deletion first), one unperturbed forward for all, and a shared all-baseline point."""
    given = Images(inputs, model)
    images, maps = given.pixels, given.maps(maps)
    batch, pixels = images.shape[0], images.shape[-2] * images.shape[-1]
    counts = step_counts(pixels, steps)
    scorer = Scorer(model, given, target, score, batch_size)
    ranks = pixel_ranks(maps)
    shared = kinds == ["deletion", "insertion"] and _same(*baselines)
    with observing(model):
        fills = [make_baseline(baselines[0], images)] * 2 if shared else [make_baseline(b, images) for b in baselines]
        # one segment of perturbed copies per curve, `batch` copies per point: (source, fill, pixels taken from fill)
        segments = []
        for kind, fill in zip(kinds, fills, strict=True):
            if kind == "deletion":
                segments.append((images, fill, counts[1:]))
            else:  # pixels revealed; the all-baseline point comes from deletion when shared
                segments.append((fill, images, counts[1:-1] if shared else counts[:-1]))
        sizes = [len(taken) * batch for _, _, taken in segments]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]

        def make(jobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            parts, part_items = [], []
            for (source, fill, taken), first, size in zip(segments, starts, sizes, strict=True):
                local = jobs[(jobs >= first) & (jobs < first + size)] - first
                if len(local):
                    items = (local % batch).to(images.device)  # point-major: one copy of each image per group
                    parts.append(replace_top(source, fill, ranks, items, taken[local // batch].to(images.device)))
                    part_items.append(items)
            return torch.cat(parts), torch.cat(part_items)

        unperturbed = scorer.unperturbed().cpu()[:, None]
        rest = run_batches(scorer, sum(sizes), make, progress=progress, desc=" and ".join(kinds))
    fractions = counts.to(rest.dtype) / pixels
    results: list[CurveResult] = []
    for kind, part in zip(kinds, rest.split(sizes), strict=True):
        scores = part.view(-1, batch).T
        if kind == "deletion":
            scores = torch.cat([unperturbed, scores], dim=1)
        else:
            shared_point = [results[0].scores[:, -1:]] if shared else []
            scores = torch.cat([*shared_point, scores, unperturbed], dim=1)
        results.append(CurveResult(kind, fractions, scores, auc(fractions, scores)))
    return results
