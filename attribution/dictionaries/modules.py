"""The dictionaries: :class:`SAE` (reads and writes one site) and :class:`Transcoder` (reads one, predicts another)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Union

import torch
from torch import nn

from . import _math

Activation = Literal["relu", "topk", "batchtopk", "jumprelu"]
ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu")


class _Sparse(nn.Module):
    """What both dictionaries share: the encoder, the activation, the decoder (``f @ W_dec + b_dec``)."""

    threshold: torch.Tensor

    def __init__(self, d_in: int, d_out: int, n_features: int, activation: str, k: int) -> None:
        super().__init__()
        for name, value in (("d_in", d_in), ("n_features", n_features), ("d_out", d_out)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int; got {value!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {ACTIVATIONS}; got {activation!r}")
        if activation in ("topk", "batchtopk") and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"`k` must be a positive int for activation={activation!r}; got {k!r}")
        self.activation: str = activation
        self.k = int(k)
        decoder = _math.unit_rows(torch.randn(n_features, d_out))
        encoder = decoder.T.clone() if d_in == d_out else _math.unit_rows(torch.randn(n_features, d_in)).T.clone()
        self.W_enc = nn.Parameter(encoder)
        self.b_enc = nn.Parameter(torch.zeros(n_features))
        self.W_dec = nn.Parameter(decoder)
        self.b_dec = nn.Parameter(torch.zeros(d_out))
        if activation == "jumprelu":
            self.register_buffer("threshold", torch.zeros(n_features))
        elif activation == "batchtopk":
            self.register_buffer("threshold", torch.zeros(()))

    @property
    def d_in(self) -> int:
        """The width of the activations read."""
        return int(self.W_enc.shape[0])

    @property
    def d_out(self) -> int:
        """The width of the activations written (``d_in`` for an SAE)."""
        return int(self.W_dec.shape[1])

    @property
    def n_features(self) -> int:
        """The number of features."""
        return int(self.W_enc.shape[1])

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the encoder multiplies by ``W_enc``: ``x`` itself (an SAE's ``x - b_dec``, see :class:`SAE`)."""
        return x

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-activations ``encoder_input(x) @ W_enc + b_enc``: ``(..., n_features)``."""
        self._check(x)
        return self.encoder_input(x) @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The activation applied to pre-activations (``batchtopk``: its inference rule, the threshold)."""
        if self.activation == "relu":
            return _math.relu(pre)
        if self.activation == "topk":
            return _math.topk(pre, self.k)
        if self.activation == "jumprelu":
            return _math.jumprelu(pre, self.threshold)
        return _math.thresholded(pre, self.threshold)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The feature activations of ``x (..., d_in)``: ``(..., n_features)``."""
        return self.activate(self.pre(x))

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """``f @ W_dec + b_dec``: ``(..., d_out)`` from features ``(..., n_features)``."""
        return f @ self.W_dec + self.b_dec

    def save(self, path: str | Path) -> Path:
        """Write the dictionary to the folder ``path`` in hookscope's format (see :func:`load_dictionary`).

        Returns:
            The folder.
        """
        from .formats import save_dictionary

        return save_dictionary(self, path)  # type: ignore[arg-type]  # self is an SAE or a Transcoder

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.d_in:
            raise ValueError(
                f"{type(self).__name__} reads vectors of width d_in={self.d_in}; got a tensor of shape "
                f"{tuple(x.shape)} (width {x.shape[-1]}): give it the activations it was trained on"
            )

    def extra_repr(self) -> str:
        k = f", k={self.k}" if self.activation in ("topk", "batchtopk") else ""
        return f"d_in={self.d_in}, n_features={self.n_features}, activation={self.activation!r}{k}"


class SAE(_Sparse):
    """A sparse autoencoder: ``encode(x) = act((x - b_dec) @ W_enc + b_enc)``, ``decode(f) = f @ W_dec + b_dec``.

    Parameters ``W_enc (d_in, n_features)``, ``b_enc (n_features)``, ``W_dec (n_features, d_in)``,
    ``b_dec (d_in)``; initialised with unit-norm decoder rows, ``W_enc = W_dec.T`` and zero biases (Gao et al. 2024).
    Activations (``pre`` the pre-activations):

    * ``"relu"``: ``relu(pre)``;
    * ``"topk"``: the ``k`` largest of ``relu(pre)`` per vector, zero elsewhere;
    * ``"batchtopk"``: in training (:func:`~attribution.train_dictionary`) the ``k x rows`` largest of ``relu(pre)``
      over the batch (Bussmann et al. 2024); in ``encode`` the learned rule ``relu(pre) * (pre > threshold)``
      with one scalar buffer ``threshold``;
    * ``"jumprelu"``: ``pre * (pre > threshold)`` with a buffer ``threshold (n_features)``.

    Args:
        d_in: the width of the site.
        n_features: the number of features.
        activation: ``"relu"``, ``"topk"``, ``"batchtopk"`` or ``"jumprelu"``.
        k: the active features per vector of ``"topk"`` and ``"batchtopk"``.
        subtract_b_dec: encode ``x - b_dec`` (default, as SAELens and sparsify); ``False`` encodes ``x`` itself (Gemma
            Scope, dictionary_learning's JumpReLU), so that those read exactly.

    Example:
        >>> sae = SAE(4, 8, activation="topk", k=2)
        >>> f = sae.encode(torch.randn(3, 4))
        >>> f.shape, int((f != 0).sum(-1).max()) <= 2, sae(torch.randn(3, 4)).shape
        (torch.Size([3, 8]), True, torch.Size([3, 4]))
    """

    def __init__(
        self, d_in: int, n_features: int, *, activation: Activation = "topk", k: int = 32, subtract_b_dec: bool = True
    ) -> None:
        super().__init__(d_in, d_in, n_features, activation, k)
        self.subtract_b_dec = bool(subtract_b_dec)

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x - b_dec`` (``x`` itself with ``subtract_b_dec=False``): what the encoder multiplies by ``W_enc``."""
        return x - self.b_dec if self.subtract_b_dec else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``decode(encode(x))``."""
        return self.decode(self.encode(x))


class Transcoder(_Sparse):
    """A transcoder: reads one site and predicts another (an MLP's output from its input; Dunefsky et al. 2024).

    ``encode(x) = act(x @ W_enc + b_enc)`` (the activations of :class:`SAE`), ``decode(f) = f @ W_dec + b_dec``,
    ``forward(x) = decode(encode(x)) + x @ W_skip`` with ``skip=True`` (a linear skip, Paulo et al. 2025).
    Parameters ``W_enc (d_in, n_features)``, ``b_enc (n_features)``, ``W_dec (n_features, d_out)``, ``b_dec (d_out)``,
    ``W_skip (d_in, d_out)`` (zeros at first).

    Args:
        d_in: the width of the site read.
        d_out: the width of the site predicted.
        n_features: the number of features.
        activation: as for :class:`SAE`.
        k: as for :class:`SAE`.
        skip: add the linear skip ``x @ W_skip``.

    Example:
        >>> tc = Transcoder(4, 6, 16, activation="relu", skip=True)
        >>> tc(torch.randn(2, 4)).shape, tc.W_skip.shape
        (torch.Size([2, 6]), torch.Size([4, 6]))
    """

    W_skip: nn.Parameter | None

    def __init__(
        self,
        d_in: int,
        d_out: int,
        n_features: int,
        *,
        activation: Activation = "topk",
        k: int = 32,
        skip: bool = False,
    ) -> None:
        super().__init__(d_in, d_out, n_features, activation, k)
        self.W_skip = nn.Parameter(torch.zeros(d_in, d_out)) if skip else None

    @property
    def skip(self) -> bool:
        """Whether the transcoder has a linear skip."""
        return self.W_skip is not None

    def skip_term(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ W_skip``, or ``None`` without a skip."""
        return None if self.W_skip is None else x @ self.W_skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The prediction ``decode(encode(x))`` (plus ``x @ W_skip``)."""
        out = self.decode(self.encode(x))
        skip = self.skip_term(x)
        return out if skip is None else out + skip

    def extra_repr(self) -> str:
        """The sizes, the activation and the skip."""
        return super().extra_repr() + f", d_out={self.d_out}" + (", skip=True" if self.skip else "")


Dictionary = Union[SAE, Transcoder]  # noqa: UP007
"""Either dictionary."""


def reconstruct(dictionary: Dictionary, features: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """What the dictionary writes from ``features``: ``decode(features)`` (plus a transcoder's skip of ``source``)."""
    out = dictionary.decode(features)
    skip = dictionary.skip_term(source) if isinstance(dictionary, Transcoder) else None
    return out if skip is None else out + skip
