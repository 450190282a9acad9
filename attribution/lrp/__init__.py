"""Layer-wise relevance propagation: rules, composites and the hooks that apply them (see :class:`attribution.LRP`).

Example:
    >>> import torch
    >>> from attribution.lrp import LRP, EpsilonGammaBox
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                             torch.nn.Linear(4 * 6 * 6, 2))
    >>> LRP(model, EpsilonGammaBox(-1.0, 1.0))(torch.randn(2, 3, 8, 8), target=1).shape
    torch.Size([2, 3, 8, 8])
"""

from .attnlrp import AttnLRP, PatchRelevance, TokenRelevance
from .composites import Composite, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from .lrp import LRP
from .rules import AlphaBeta, Epsilon, Flat, Gamma, Pass, Rule, WSquare, ZBox, ZPlus

__all__ = [
    "LRP",
    "AlphaBeta",
    "AttnLRP",
    "Composite",
    "Epsilon",
    "EpsilonAlpha2Beta1",
    "EpsilonGammaBox",
    "EpsilonPlus",
    "EpsilonPlusFlat",
    "Flat",
    "Gamma",
    "Pass",
    "PatchRelevance",
    "Rule",
    "TokenRelevance",
    "WSquare",
    "ZBox",
    "ZPlus",
]
