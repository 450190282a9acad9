"""The units whose meaning is read: MLP neurons, attention heads, dictionary features and directions, in one spelling.

Each kind says where its activations are read (a module's output or input), how they are computed from the site's
tensor, and which vector each unit writes into the residual stream (for logit effects and neighbours by cosine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from hooks import resolve

from ..dictionaries import SAE, Transcoder
from ..models import LayerLayout, LMLayout, linear, lm_layout

Side = Literal["output", "input"]


@dataclass(frozen=True)
class Bound:
    """A unit kind bound to a model: where it is read and what it computes (used by the pass)."""

    module: str
    side: Side
    width: int
    """How many units."""
    labels: list[str]
    encode: object
    """``(..., d) -> (..., width)``: the units' activations from the site's tensor."""
    writes: torch.Tensor | None
    """``(width, d_model)`` what each unit writes into the residual stream (``None``: not known)."""
    identity: str
    """Text that changes when the units do (for resumed runs)."""
    source: dict[str, object] = field(default_factory=dict)
    """``kind`` (``"neuron"``, ``"feature"``, ``"direction"``), ``module``, ``side``, ``layer`` (the decoder layer the
    site is in, or ``None``) and ``indices`` (the neuron or feature numbers, or direction rows): where units come
    from, for looking them up by what a graph node names (:meth:`UnitReport.find`)."""


def _indices(indices: Sequence[int] | None, size: int, what: str) -> torch.Tensor:
    if indices is None:
        return torch.arange(size)
    chosen = torch.as_tensor(list(indices), dtype=torch.long)
    if chosen.dim() != 1 or (len(chosen) and (int(chosen.min()) < 0 or int(chosen.max()) >= size)):
        raise ValueError(f"`indices` of {what} must be integers in [0, {size}); got {list(indices)[:10]}")
    return chosen


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Neurons:
    """The MLP neurons of one layer of a language model: the input of its down projection (``act(gate) * up``).

    Args:
        layer: the decoder layer's index (negative counts from the end).
        indices: the neurons to read (default: all of them), in this order.

    Example:
        >>> Neurons(3, indices=[7, 1])
        Neurons(layer=3, indices=(7, 1))
    """

    layer: int
    indices: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.indices is not None:
            object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))

    def bind(self, model: nn.Module) -> Bound:
        """Where the neurons are in ``model`` (through :func:`attribution.models.lm_layout`)."""
        layer = _decoder_layer(lm_layout(model), self.layer)
        if layer.mlp_parts is None:
            raise ValueError(f"layer {layer.index} has no MLP with known parts (a mixture of experts?): use Directions")
        name = layer.mlp_parts.neurons
        down = linear(model.get_submodule(name), device=torch.device("cpu"))[0].detach().float()  # (d_model, d_mlp)
        chosen = _indices(self.indices, down.shape[1], "Neurons")
        return Bound(
            module=name,
            side="input",
            width=len(chosen),
            labels=[f"L{layer.index}/N{int(i)}" for i in chosen],
            encode=lambda x: x[..., chosen.to(x.device)],
            writes=down[:, chosen].T.contiguous(),
            identity=f"Neurons({name}, {chosen.tolist()})",
            source=_source("neuron", name, "input", layer.index, chosen),
        )


@dataclass(frozen=True)
class Heads:
    """The attention heads of one layer of a language model: each head's activation is the size of what it writes.

    A head's output at a position is its slice ``z_h`` of the attention output projection's input (``head_dim``
    values) times its columns ``W_O[:, h]`` of that projection: the vector it adds to the residual stream (the
    projection's bias belongs to no head). The unit's activation is that vector's L2 norm, so it is never negative and
    its top examples are the positions where the head writes most. A head writes a subspace, not one direction, so it
    has no logit effects; read a direction it writes with :class:`Directions`.

    Args:
        layer: the decoder layer's index (negative counts from the end).
        indices: the (query) heads to read (default: all of them), in this order.

    Example:
        >>> Heads(2, indices=[0, 5])
        Heads(layer=2, indices=(0, 5))
    """

    layer: int
    indices: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.indices is not None:
            object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))

    def bind(self, model: nn.Module) -> Bound:
        """Where the heads are in ``model`` (through :func:`attribution.models.lm_layout`)."""
        layout = lm_layout(model)
        layer = _decoder_layer(layout, self.layer)
        name = layer.attention.out_proj
        out = linear(model.get_submodule(name), device=torch.device("cpu"))[0].detach().float()  # (d_model, h * d)
        n, size = layout.n_heads, layout.head_dim
        if out.shape[1] != n * size:
            raise ValueError(
                f"{name!r} reads {out.shape[1]} values, not {n} heads x {size}: give the model's head layout to "
                "attribution.models.lm_layout, or read the heads' outputs with Directions"
            )
        chosen = _indices(self.indices, n, "Heads")
        blocks = out.T.reshape(n, size, -1)[chosen]  # (heads, head_dim, d_model)

        def encode(x: torch.Tensor) -> torch.Tensor:
            z = x.reshape(*x.shape[:-1], n, size)[..., chosen.to(x.device), :].float()
            return torch.einsum("...hk,hkd->...hd", z, blocks.to(x.device)).norm(dim=-1)

        return Bound(
            module=name,
            side="input",
            width=len(chosen),
            labels=[f"L{layer.index}/H{int(i)}" for i in chosen],
            encode=encode,
            writes=None,
            identity=f"Heads({name}, {chosen.tolist()}, {_digest(out)})",
            source=_source("head", name, "input", layer.index, chosen),
        )


@dataclass(frozen=True)
class Features:
    """The features of a sparse dictionary (:class:`~attribution.SAE` or :class:`~attribution.Transcoder`).

    Args:
        dictionary: the dictionary.
        site: the module whose activations it reads, as in :func:`~attribution.splice` (an SAE reads the output, or
            the input with ``side="input"``; a transcoder reads the module's input).
        indices: the features to read (default: all), in this order.
        side: where an SAE reads its site.
    """

    dictionary: nn.Module
    site: str
    indices: Sequence[int] | None = None
    side: Side = "output"

    def __post_init__(self) -> None:
        if not isinstance(self.dictionary, (SAE, Transcoder)):
            raise TypeError(
                f"`dictionary` must be an SAE or a Transcoder; got {type(self.dictionary).__name__} (load one with "
                "attribution.load_dictionary)"
            )
        if self.indices is not None:
            object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))

    def bind(self, model: nn.Module) -> Bound:
        """Where the features are read in ``model``."""
        _module(model, self.site)
        d: Any = self.dictionary
        chosen = _indices(self.indices, d.n_features, "Features")
        side: Side = "input" if isinstance(d, Transcoder) else self.side

        def encode(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return d.encode(x.to(d.W_enc.dtype))[..., chosen.to(x.device)]

        writes = d.W_dec.detach().float().cpu()[chosen]
        prefix = _prefix(model, self.site)
        return Bound(
            module=self.site,
            side=side,
            width=len(chosen),
            labels=[f"{prefix}F{int(i)}" for i in chosen],
            encode=encode,
            writes=writes,
            source=_source("feature", self.site, side, _layer_of(model, self.site), chosen),
            identity=f"Features({type(d).__name__}, {self.site}, {side}, {_digest(*d.state_dict().values())}, "
            f"{chosen.tolist()})",
        )


@dataclass(frozen=True)
class Directions:
    """Directions at a site: each unit's activation is the dot product of its vector with the site's tensor.

    Args:
        vectors: ``(n, d)`` one direction per row (a probe's weights, a CAV, a steering vector, ``diff_means``).
        site: the module whose output (or input, with ``side="input"``) is read.
        side: the module's ``"output"`` or ``"input"``.
        names: a label per direction (default ``D0``, ``D1``, ...).
    """

    vectors: torch.Tensor
    site: str
    side: Side = "output"
    names: Sequence[str] | None = field(default=None)

    def __post_init__(self) -> None:
        v = self.vectors
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() not in (1, 2):
            raise TypeError(f"`vectors` must be a float tensor (n, d) or (d,); got {_shape(v)}")
        object.__setattr__(self, "vectors", v.detach().reshape(-1, v.shape[-1]))
        if self.names is not None and len(self.names) != len(self.vectors):
            raise ValueError(f"`names` has {len(self.names)} labels for {len(self.vectors)} directions")

    def bind(self, model: nn.Module) -> Bound:
        """Where the directions are read in ``model``."""
        _module(model, self.site)
        v = self.vectors

        def encode(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != v.shape[1]:
                raise ValueError(
                    f"`vectors` have width {v.shape[1]}, but the {self.side} of {self.site!r} has shape "
                    f"{tuple(x.shape)}: give directions of width {x.shape[-1]}"
                )
            return x @ v.to(x.device, x.dtype).T

        labels = list(self.names) if self.names is not None else [f"D{i}" for i in range(len(v))]
        return Bound(
            module=self.site,
            side=self.side,
            width=len(v),
            labels=labels,
            encode=encode,
            writes=v.float().cpu(),
            identity=f"Directions({self.site}, {self.side}, {_digest(v)})",
            source=_source("direction", self.site, self.side, _layer_of(model, self.site), torch.arange(len(v))),
        )


Units = Neurons | Heads | Features | Directions


def _decoder_layer(layout: LMLayout, index: int) -> LayerLayout:
    """Decoder layer ``index`` of the layout (negative counts from the end), or an error naming the range."""
    layers = layout.layers
    if not -len(layers) <= index < len(layers):
        raise ValueError(
            f"`layer` {index} is not a layer of the model: it has {len(layers)} layers (0 to {len(layers) - 1})"
        )
    return layers[index]


def _source(kind: str, module: str, side: str, layer: int | None, indices: torch.Tensor) -> dict[str, object]:
    return {"kind": kind, "module": module, "side": side, "layer": layer, "indices": indices.tolist()}


def _layer_of(model: nn.Module, site: str) -> int | None:
    """The decoder layer whose module holds ``site`` (``None``: not a language model's layer, or none)."""
    try:
        layers = lm_layout(model).layers
    except ValueError:
        return None
    for layer in layers:
        if site == layer.module or site.startswith(layer.module + "."):
            return layer.index
    return None


def _prefix(model: nn.Module, site: str) -> str:
    """``"L3/"`` for a site in layer 3, else ``"<site>/"``."""
    layer = _layer_of(model, site)
    return f"L{layer}/" if layer is not None else f"{site}/"


def _module(model: nn.Module, site: str) -> None:
    """``site`` must name one module of ``model`` (unknown names are answered with the closest ones)."""
    if not isinstance(site, str):
        raise TypeError(f"`site` must be a module's qualified name; got {type(site).__name__}")
    found = resolve(model, site, "`site`")
    if len(found) != 1:
        raise ValueError(f"`site` {site!r} matches {len(found)} modules; name one (see hooks.module_names(model))")


def _shape(x: object) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def bind_all(model: nn.Module, units: Units | Sequence[Units]) -> list[Bound]:
    """Each unit kind bound to ``model``; a list of kinds numbers its units one after the other."""
    kinds = [units] if isinstance(units, (Neurons, Heads, Features, Directions)) else list(units)
    if not kinds or not all(isinstance(u, (Neurons, Heads, Features, Directions)) for u in kinds):
        raise TypeError(
            "`units` must be Neurons(layer), Heads(layer), Features(dictionary, site) or Directions(vectors, site), "
            f"or a list of them; got {type(units).__name__}"
        )
    return [u.bind(model) for u in kinds]
