"""What every method with a convergence delta returns with ``return_delta=True``: one pair, attributions and delta."""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttributionsWithDelta(NamedTuple):
    """The attributions and, per item, how far their sum is from the change of the target score.

    A pair, as captum returns it: ``attributions, delta = method(x, return_delta=True)`` unpacks it, and
    ``.attributions`` / ``.delta`` name its two fields. Returned by :class:`~attribution.IntegratedGradients`,
    :class:`~attribution.DeepLift`, :class:`~attribution.DeepLiftShap` and :class:`~attribution.GradientShap`.

    Example:
        >>> import torch
        >>> result = AttributionsWithDelta(torch.ones(1, 2), torch.zeros(1))
        >>> attributions, delta = result
        >>> attributions is result.attributions, delta
        (True, tensor([0.]))
    """

    attributions: torch.Tensor
    delta: torch.Tensor


AttributionsWithDelta.attributions.__doc__ = "``(batch, ...)``: shaped like the inputs (or the layer's output)."
AttributionsWithDelta.delta.__doc__ = (
    "``(batch,)``: ``sum(attributions) - (S(x) - S(baseline))`` (captum's convergence delta), ``S(baseline)`` "
    "averaged over the references for DeepLiftShap and GradientShap."
)
