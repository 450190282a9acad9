"""Norms read as affine maps after a frozen scale, and the gain convention of an RMSNorm.

:func:`norm_affine` reads a LayerNorm or RMSNorm as ``gain * centre(x) / scale + shift`` and checks that reading
against the module itself, so that a frozen-scale linearisation is never silently wrong for a norm of an unknown
kind. :func:`rms_norm_gain` tells whether an RMSNorm multiplies by ``weight`` (Llama) or ``1 + weight`` (Gemma).
:func:`is_rms_norm` and :func:`norm_kind` say which modules are norms. Weights are read through
:func:`attribution.models.weights.weight`, so offloaded norms give their real values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from . import weights
from .weights import execution_device

__all__ = ["NormAffine", "NormKind", "is_rms_norm", "norm_affine", "norm_eps", "norm_kind", "rms_norm_gain"]

NormKind = Literal["rms", "layer"]


def is_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm with a ``weight`` (HuggingFace's ``*RMSNorm`` classes, ``nn.RMSNorm``)."""
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def norm_kind(module: nn.Module) -> NormKind | None:
    """``"rms"`` for an RMSNorm with a weight, ``"layer"`` for an ``nn.LayerNorm``, else ``None``.

    Example:
        >>> norm_kind(torch.nn.LayerNorm(4)), norm_kind(torch.nn.Linear(2, 2))
        ('layer', None)
    """
    if is_rms_norm(module):
        return "rms"
    return "layer" if isinstance(module, nn.LayerNorm) else None


def norm_eps(module: nn.Module, default: float = 1e-6) -> float:
    """The epsilon a norm adds to its mean square (``eps`` or HuggingFace's ``variance_epsilon``)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(default if eps is None else eps)


@dataclass(frozen=True)
class NormAffine:
    """A norm read as ``gain * centre(x) / scale(x) + shift`` (``centre`` subtracts the mean for LayerNorm)."""

    gain: torch.Tensor
    shift: torch.Tensor | None
    eps: float
    centred: bool

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``sqrt(mean(centre(x)^2) + eps)`` over the last axis, kept as ``(..., 1)``."""
        c = self.centre(x)
        return (c.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def centre(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` minus its mean over the last axis for LayerNorm; ``x`` itself for RMSNorm."""
        return x - x.mean(-1, keepdim=True) if self.centred else x

    def frozen(self, component: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The norm's linear part applied to one component of the residual stream, at a frozen ``scale``."""
        return self.gain * self.centre(component) / scale


def norm_affine(norm: nn.Module, probe: torch.Tensor) -> NormAffine:
    """Read ``norm`` as an affine map after a frozen scale, and check the reading on ``probe``.

    LayerNorm and RMSNorm modules (HuggingFace's ``*RMSNorm``, with Gemma's ``1 + weight`` gain) are read from
    their parameters; the reading must reproduce ``norm(probe)`` (to 1e-4 of its size in the probe's precision),
    else the norm is not one we understand and a ``ValueError`` says so.

    Args:
        norm: the norm module.
        probe: an input the norm sees, ``(..., hidden)``.

    Returns:
        The reading.

    Raises:
        ValueError: a norm of an unknown kind.
    """
    weight, bias = weights.weight(norm, "weight"), weights.weight(norm, "bias")
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    hidden = probe.shape[-1]
    ones = torch.ones(hidden, dtype=probe.dtype, device=probe.device)
    gain = ones if weight is None else weight.to(probe.device, probe.dtype)
    candidates = [NormAffine(gain, bias.to(probe.device, probe.dtype) if bias is not None else None, float(eps or 0), c)
                  for c in (isinstance(norm, nn.LayerNorm), not isinstance(norm, nn.LayerNorm))]  # fmt: skip
    if weight is not None and "gemma" in type(norm).__name__.lower():
        candidates.insert(0, NormAffine(gain + 1, None, float(eps or 0), False))
    dtype = probe.dtype if weight is None else weight.dtype  # a float32 LayerNorm refuses a float64 input
    with torch.no_grad():
        expected = norm(probe.to(execution_device(norm) or probe.device, dtype)).to(probe.device, probe.dtype)
        for reading in candidates:
            got = reading.frozen(probe, reading.scale(probe)) + (0 if reading.shift is None else reading.shift)
            if torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp_min(1e-12))):
                return reading
    raise ValueError(
        f"the final norm {type(norm).__name__} is neither a LayerNorm nor an RMSNorm as far as its parameters tell "
        "(weight, bias, eps): its scale cannot be frozen; pass the name of a LayerNorm/RMSNorm module"
    )


def rms_norm_gain(norm: nn.Module, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel gain an RMSNorm multiplies by: ``weight`` (Llama, Qwen2, Mistral) or ``1 + weight`` (Gemma).

    Read from the module itself: its output for an input of ones is ``gain / sqrt(1 + eps)``.

    Raises:
        ValueError: the output fits neither convention (a norm this rule does not know).

    Example:
        >>> class OffsetRMSNorm(torch.nn.Module):      # Gemma's convention
        ...     def __init__(self):
        ...         super().__init__(); self.weight, self.eps = torch.nn.Parameter(torch.zeros(2)), 1e-6
        ...     def forward(self, x):
        ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)
        >>> rms_norm_gain(OffsetRMSNorm(), torch.zeros(2), 1e-6)
        tensor([1., 1.])
    """
    with torch.no_grad():
        ones = torch.ones(1, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        probe = norm.forward(ones).reshape(-1).to(weight.device, weight.dtype) * (1 + eps) ** 0.5
    gain = min((weight, 1 + weight), key=lambda g: float((probe - g).abs().max()))  # the closer convention
    if torch.allclose(probe, gain, rtol=1e-3, atol=1e-5):
        return gain
    raise ValueError(
        f"{type(norm).__name__} multiplies by neither its `weight` nor `1 + weight` (its output for ones is "
        f"{probe[:3].tolist()}..., its weight {weight[:3].tolist()}...): the norm rule does not know this RMSNorm"
    )
