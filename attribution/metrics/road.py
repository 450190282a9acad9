"""ROAD, RemOve And Debias (Rong et al., 2022): remove pixels by saliency, impute them so the mask does not leak."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._impute import noisy_linear_imputation
from ._perturb import derived_seed, pixel_ranks
from ._scoring import Images, Scorer, Target, observing, run_batches

PERCENTILES = (10, 20, 30, 40, 50, 60, 70, 80, 90)


@dataclass(frozen=True)
class RoadResult:
    """ROAD curves per image: the target's score with the most (MoRF) or least (LeRF) relevant pixels imputed.

    Attributes:
        percentiles: ``(P,)`` share of the pixels removed and imputed at each point, in percent.
        morf: ``(B, P)`` score with the most relevant pixels removed first (a faithful map makes it fall fast).
        lerf: ``(B, P)`` score with the least relevant pixels removed first (a faithful map keeps it high).
        score: ``(B,)`` score of the unperturbed image.
        morf_auc: ``(B,)`` mean of ``morf`` over the percentiles (lower is better).
        lerf_auc: ``(B,)`` mean of ``lerf`` over the percentiles (higher is better).
        auc: ``(B,)`` ``(lerf_auc - morf_auc) / 2``, higher is better: pytorch-grad-cam's ``ROADCombined``.
    """

    percentiles: torch.Tensor
    morf: torch.Tensor
    lerf: torch.Tensor
    score: torch.Tensor
    morf_auc: torch.Tensor
    lerf_auc: torch.Tensor
    auc: torch.Tensor


def road(
    model: nn.Module,
    inputs: Any,
    maps: torch.Tensor,
    target: Target = None,
    *,
    percentiles: Sequence[float] = PERCENTILES,
    noise: float = 0.01,
    seed: int = 0,
    score: str = "probability",
    batch_size: int = 32,
    progress: bool = False,
) -> RoadResult:
    """ROAD (Rong et al., 2022, https://arxiv.org/abs/2202.00449): remove and debias, MoRF and LeRF.

    For each percentile ``p``, the ``round(p / 100 * H * W)`` pixels ranked highest by the map (MoRF) or lowest
    (LeRF) are removed (all channels of a pixel; ties in raster order) and imputed by noisy linear imputation: each
    removed pixel becomes the weighted mean of its 8 neighbours (weights 1/6 direct, 1/12 diagonal; removed
    neighbours count with their imputed values), plus Gaussian noise of standard deviation ``noise``. Imputing
    instead of painting a constant keeps the shape of the removed region from telling the model where it was.

    Args:
        model: the classifier; run in eval mode without autograd, left exactly as it was.
        inputs: the images, in the forms of :func:`attribution.metrics.deletion`.
        maps: ``(B, H, W)`` saliency maps at the input's size (or one ``(H, W)`` map), higher meaning more salient.
        target: whose score, in the same forms as :func:`attribution.metrics.deletion`.
        percentiles: the shares of pixels to remove, in percent, each strictly between 0 and 100.
        noise: standard deviation of the noise on imputed values, in input units (ROAD: 0.01); 0 for none.
        seed: seeds the noise; each perturbed image draws from its own generator, seeded from ``seed``, the image's
            position in the batch and the point, so the result does not depend on ``batch_size`` or on the images
            after it, and the global random state is not touched.
        score: for class targets, the class's softmax ``"probability"`` or its ``"logit"``.
        batch_size: perturbed images per imputation and forward.
        progress: show a progress bar on a terminal (it appears once the call has run for a second).

    Returns:
        :class:`RoadResult`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4)).eval()
        >>> result = road(model, torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8), percentiles=[25, 50])
        >>> result.morf.shape, result.auc.shape
        (torch.Size([2, 2]), torch.Size([2]))
    """
    given = Images(inputs, model)
    images, maps = given.pixels, given.maps(maps)
    batch, pixels = images.shape[0], images.shape[-2] * images.shape[-1]
    shares = torch.as_tensor(list(percentiles), dtype=torch.float64)
    if shares.dim() != 1 or not len(shares) or not ((shares > 0) & (shares < 100)).all():
        raise ValueError(f"`percentiles` must be values strictly between 0 and 100; got {list(percentiles)}")
    if not isinstance(noise, (int, float)) or noise < 0:
        raise ValueError(f"`noise` must be a standard deviation >= 0; got {noise!r}")
    counts = torch.round(shares / 100 * pixels).long().to(images.device)
    scorer = Scorer(model, given, target, score, batch_size)
    ranks = pixel_ranks(maps)
    points = len(shares)
    with observing(model):

        def make(jobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            jobs = jobs.to(images.device)
            items, curve = jobs % batch, jobs // batch  # point-major: one copy of each image per group
            order, point = curve // points, curve % points  # MoRF points first, then LeRF
            k = counts[point][:, None]
            removed = torch.where(order[:, None] == 0, ranks[items] < k, ranks[items] >= pixels - k)
            removed = removed.view(len(jobs), *images.shape[-2:])
            # an image's noise depends on its curve and point, not on `batch_size` or on the batch's length
            seeds = [noise_seed(seed, int(i), int(c)) for i, c in zip(items.tolist(), curve.tolist(), strict=True)]
            return noisy_linear_imputation(images[items], removed, noise=noise, seeds=seeds), items

        unperturbed = scorer.unperturbed().cpu()
        curves = run_batches(scorer, 2 * points * batch, make, progress=progress, desc="ROAD")
    curves = curves.view(2, points, batch).permute(2, 0, 1)
    morf, lerf = curves[:, 0], curves[:, 1]
    morf_auc, lerf_auc = morf.mean(dim=1), lerf.mean(dim=1)
    return RoadResult(shares, morf, lerf, unperturbed, morf_auc, lerf_auc, (lerf_auc - morf_auc) / 2)


def noise_seed(seed: int, item: int, curve: int) -> int:
    """The seed of the noise of image ``item`` at ``curve`` (MoRF points, then LeRF): the same in every process."""
    return derived_seed(seed, item, curve)
