"""Attribution methods built on :mod:`hooks`: each call registers and removes its own hook group.

Example:
    >>> import torch, torchvision
    >>> from attribution import GradCAM
    >>> model = torchvision.models.resnet18(weights=None).eval()
    >>> saliency = GradCAM(model, "layer4")(torch.randn(1, 3, 64, 64))
    >>> saliency.shape, float(saliency.min()) >= 0, float(saliency.max()) <= 1
    (torch.Size([1, 64, 64]), True, True)
"""

from . import circuits, targets
from .cam import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from .circuits import (
    Circuit,
    EdgeScores,
    edge_attribution,
    evaluate,
    exact_edge_effects,
    faithfulness,
    faithfulness_curve,
)
from .dataset import attribute_dataset, open_results
from .patching import Patch, activation_patching, patch, record
from .rollout import AttentionRollout, GradientRollout

__all__ = [
    "AttentionRollout",
    "Circuit",
    "EdgeScores",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradientRollout",
    "HiResCAM",
    "LayerCAM",
    "Patch",
    "ScoreCAM",
    "XGradCAM",
    "activation_patching",
    "attribute_dataset",
    "circuits",
    "edge_attribution",
    "evaluate",
    "exact_edge_effects",
    "faithfulness",
    "faithfulness_curve",
    "open_results",
    "patch",
    "record",
    "targets",
]
