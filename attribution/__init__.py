"""Attribution methods built on :mod:`hooks`: each call registers and removes its own hook group.

Example:
    >>> import torch, torchvision
    >>> from attribution import GradCAM
    >>> model = torchvision.models.resnet18(weights=None).eval()
    >>> saliency = GradCAM(model, "layer4")(torch.randn(1, 3, 64, 64))
    >>> saliency.shape, float(saliency.min()) >= 0, float(saliency.max()) <= 1
    (torch.Size([1, 64, 64]), True, True)
"""

from . import targets
from .cam import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from .dataset import attribute_dataset, open_results
from .lrp import LRP, AttnLRP
from .patching import Patch, activation_patching, patch, record
from .rollout import AttentionRollout, GradientRollout

__all__ = [
    "AttentionRollout",
    "AttnLRP",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradientRollout",
    "HiResCAM",
    "LRP",
    "LayerCAM",
    "Patch",
    "ScoreCAM",
    "XGradCAM",
    "activation_patching",
    "attribute_dataset",
    "open_results",
    "patch",
    "record",
    "targets",
]
