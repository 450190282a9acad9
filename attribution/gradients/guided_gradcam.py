"""Guided Grad-CAM: Guided Backprop times the raw Grad-CAM map, upsampled to the input."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..cam import GradCAM
from ..targets import Target, check_target
from ._base import GradientMethod
from ._site import check_result
from .guided import DEFAULT_ACTIVATIONS, GuidedBackprop

MODES = ("nearest", "nearest-exact", "bilinear", "bicubic", "area")


class GuidedGradCAM(GradientMethod):
    """Guided Grad-CAM (Selvaraju et al., 2017, https://arxiv.org/abs/1610.02391).

    ``GB(x) * up(L)``: the :class:`GuidedBackprop` attributions times the Grad-CAM map
    ``L = ReLU(sum_k a_k A_k)`` of ``layer`` (raw: neither min-max scaled nor smoothed), upsampled to the input's
    ``(H, W)`` by ``torch.nn.functional.interpolate`` with ``mode=upsample`` and broadcast over channels. The same as
    captum's ``GuidedGradCam`` with ``interpolate_mode=upsample``: both read the layer's true output (see
    :class:`attribution.GradCAM`), also at a layer followed by an in-place ReLU.

    Args:
        model: the network.
        layer: the layer of the Grad-CAM map (a 4-D output).
        upsample: the interpolation mode: ``"nearest"`` (captum's default), ``"nearest-exact"``, ``"bilinear"``,
            ``"bicubic"`` or ``"area"``.
        activations: the module types whose backward Guided Backprop changes.

    Example:
        >>> import torch, torchvision
        >>> from attribution import GuidedGradCAM
        >>> model = torchvision.models.resnet18(weights=None).eval()
        >>> GuidedGradCAM(model, "layer3")(torch.randn(2, 3, 64, 64), target=3).shape
        torch.Size([2, 3, 64, 64])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module,
        upsample: str = "nearest",
        *,
        activations: Sequence[type[nn.Module]] = DEFAULT_ACTIVATIONS,
    ) -> None:
        super().__init__(model, layer=layer)
        if upsample not in MODES:
            raise ValueError(f"`upsample` must be one of {', '.join(repr(m) for m in MODES)}; got {upsample!r}")
        self.upsample = upsample
        assert self.layer is not None
        self.gradcam = GradCAM(self.model, self.layer)
        self.guided = GuidedBackprop(self.model, activations=activations)

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The Guided Grad-CAM attributions, shaped like ``inputs`` ``(B, C, H, W)``."""
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4 or not inputs.is_floating_point():
            got = f"{tuple(inputs.shape)} {inputs.dtype}" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise TypeError(f"GuidedGradCAM takes images: `inputs` a floating-point (B, C, H, W) tensor; got {got}")
        check_target(target, inputs.shape[0])
        cam = self.gradcam(inputs, target, upsample=False, normalize=False)
        guided = self.guided(inputs, target)
        cam = F.interpolate(cam[:, None].to(guided.dtype), size=tuple(inputs.shape[2:]), mode=self.upsample)
        return check_result(guided * cam, "GuidedGradCAM")
