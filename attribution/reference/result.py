"""What a reference method returns with ``return_delta=True``: the attributions and the convergence deltas."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttributionsWithDelta:
    """The attributions and, per item, how far their sum is from the change of the target score.

    Attributes:
        attributions: ``(batch, ...)``, shaped like the inputs.
        delta: ``(batch,)``: ``sum(attributions) - (S(x) - S(baseline))`` (captum's convergence delta), with
            ``S(baseline)`` averaged over the references for :class:`~attribution.DeepLiftShap` and
            :class:`~attribution.GradientShap`.

    Example:
        >>> result = AttributionsWithDelta(torch.ones(1, 2), torch.zeros(1))
        >>> attributions, delta = result.attributions, result.delta
        >>> delta
        tensor([0.])
    """

    attributions: torch.Tensor
    delta: torch.Tensor
