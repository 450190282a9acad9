"""The gradient-weighted CAMs: Grad-CAM, Grad-CAM++, XGrad-CAM, HiRes-CAM, LayerCAM."""

from __future__ import annotations

import torch

from .. import _maps
from . import _math as cm
from ._base import CAM


class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al., 2017, https://arxiv.org/abs/1610.02391).

    ``L = ReLU(sum_k a_k A_k)`` with ``a_k = mean_ij dS/dA_kij``: ``A`` the layer's output, ``S`` the target score.

    Args:
        model: the network.
        layers: the layer(s) whose output is explained: a name, glob, module, or list (see the module docs); with
            several, the maps are fused.
        layer: exactly one layer, by keyword (``layer="layer4"``); several with ``layer=`` still work but are
            deprecated (a ``DeprecationWarning`` names ``layers``).
        reshape: for token layers whose grid is not found automatically: an einops pattern to
            ``(batch, channels, h, w)`` (``"b h w c -> b c h w"`` for Swin) or a callable.
        call: which call to use when the layer runs several times in one forward (default: the last).

    Example:
        >>> import torch, torchvision
        >>> from attribution import GradCAM
        >>> model = torchvision.models.resnet18(weights=None).eval()
        >>> GradCAM(model, "layer4")(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 64, 64])
    """

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.gradcam_weights(acts, grads)


class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhyay et al., 2018, https://arxiv.org/abs/1710.11063).

    ``L = ReLU(sum_k w_k A_k)``, ``w_k = sum_ij alpha_kij ReLU(g_kij)``,
    ``alpha_kij = g_kij^2 / (2 g_kij^2 + sum_ab A_kab g_kij^3)`` (0 where the denominator is 0), with ``g = dS/dA``:
    the paper's closed form for ``Y = exp(S)``, whose positive factor ``exp(S)`` is dropped. Same arguments as
    :class:`GradCAM`.
    """

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.gradcam_plus_plus_weights(acts, grads)


class XGradCAM(CAM):
    """XGrad-CAM (Fu et al., 2020, https://arxiv.org/abs/2008.02312).

    ``L = ReLU(sum_k w_k A_k)``, ``w_k = sum_ij (A_kij / sum_ab A_kab) dS/dA_kij``. Same arguments as
    :class:`GradCAM`.
    """

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.xgradcam_weights(acts, grads)


class HiResCAM(CAM):
    """HiRes-CAM (Draelos & Carin, 2020, https://arxiv.org/abs/2011.08891).

    ``L = ReLU(sum_k dS/dA_k * A_k)``: the gradient is kept per position instead of averaged, so the map shows
    what the score actually used. Same arguments as :class:`GradCAM`.
    """

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.hirescam_weights(acts, grads)


class LayerCAM(CAM):
    """LayerCAM (Jiang et al., 2021, https://doi.org/10.1109/TIP.2021.3089943).

    ``L = ReLU(sum_k ReLU(dS/dA_k) * A_k)``: position-wise weights, only positive gradients. Works well on shallow
    layers. With several layers, calling the object gives the paper's fusion: each layer's map (upsampled to the
    finest resolution among them) scaled by ``tanh(2 M / max M)``, the elementwise maximum of those, then min-max.
    Same arguments as :class:`GradCAM`.
    """

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.layercam_weights(acts, grads)

    def _fuse(self, maps: list[torch.Tensor]) -> torch.Tensor:
        """The paper's fusion: each map scaled by ``tanh(2 M / max M)``, then the elementwise maximum."""
        size = max((tuple(m.shape[-2:]) for m in maps), key=lambda s: s[0] * s[1])
        scaled = []
        for m in maps:
            m = _maps.upsample(m, size)
            top = m.flatten(1).amax(1).clamp(min=1e-12).view(-1, 1, 1)
            scaled.append(torch.tanh(2 * m / top))
        return _maps.minmax(torch.stack(scaled).amax(dim=0))
