"""The machinery every CAM shares: resolve layers, run the model, capture activations (and gradients), maps."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from hooks import resolve

from .. import _maps
from .._diagnose import ZERO_HEAD, items, output_ignores_input
from .._inputs import batch_size, batched, describe, device_of, image_size
from .._run import HookedRun, SiteTypeError, did_not_run, eager_module, no_dependence, warn
from ..targets import Target, check_target, target_scores
from . import _math as cm

Reshape = str | Callable[[torch.Tensor], torch.Tensor] | None
Layers = str | nn.Module | Sequence[str | nn.Module]
_DEGENERATE = 1e-3  # a map below this fraction of its largest weight x activation term shows only rounding


def _layer_names(model: nn.Module, layers: Layers | None, layer: Layers | None) -> list[str]:
    """The CAM's layers: ``layers`` (one or more), or ``layer=`` (one; several still work, with a deprecation)."""
    if (layers is None) == (layer is None):
        raise TypeError(
            "give the modules once: `layers` (one or more: a name, glob, module or list) or `layer=` (exactly one)"
            + ("; got both" if layers is not None else "; got neither")
        )
    chosen = layers if layers is not None else layer
    names = [name for name, _ in resolve(model, chosen, what="`layer`")]  # type: ignore[arg-type]
    if layer is not None and len(names) > 1:
        warn(
            f"`layer=` names one module; for several ({len(names)} here) pass `layers=`: `layer=` with several "
            "modules is deprecated",
            DeprecationWarning,
        )
    return names


class CAM:
    """Shared machinery: resolve layers, run the model, capture activations (and gradients), build maps."""

    uses_gradients: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        layer: Layers | None = None,
        reshape: Reshape = None,
        call: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = eager_module(model)  # torch.compile(model): its module, run eagerly (hooks need that)
        self.layers = _layer_names(self.model, layers, layer)
        self.reshape = reshape
        self.call = call
        self.prefix_tokens = getattr(self.model, "num_prefix_tokens", None)  # timm ViTs: tokens before the grid

    # -- public API ------------------------------------------------------------------------------------------
    def __call__(
        self, inputs: Any, target: Target = None, *, upsample: bool = True, normalize: bool = True
    ) -> torch.Tensor:
        """Compute the map of ``target`` for ``inputs``; see the module documentation for the exact semantics.

        With several layers the fused map is returned, always scaled to [0, 1] (``normalize`` is ignored).
        """
        several = len(self.layers) > 1
        maps = self.layer_maps(inputs, target, upsample=upsample, normalize=normalize and not several)
        if not several:
            return next(iter(maps.values()))
        fused = self._fuse([m[None] if m.dim() == 2 else m for m in maps.values()])
        return fused[0] if next(iter(maps.values())).dim() == 2 else fused

    def layer_maps(
        self, inputs: Any, target: Target = None, *, upsample: bool = True, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        """One map per target layer, by layer name (same options as calling the object)."""
        given = batched(inputs, self.model, images=True)
        batch = batch_size(given.inputs)
        check_target(target, batch)
        size = image_size(given.inputs)
        if upsample and size is None:
            raise ValueError(
                f"`upsample=True` takes the maps' size from the images, but `inputs` {describe(inputs)} holds none: "
                "images are (B, C, H, W) or (C, H, W) tensors, pixel_values, or a list of (C, H, W) images of one "
                "size. Pass upsample=False for maps at the layer's grid"
            )
        raw = self._raw_maps(given.inputs, target, size)
        out = {}
        for name, m in raw.items():
            if upsample:
                assert size is not None
                m = _maps.upsample(m, size)
            if normalize:
                m = _maps.minmax(m)
            m = m.to(device_of(inputs))
            out[name] = m[0] if given.single else m
        return out

    # -- machinery -------------------------------------------------------------------------------------------
    def _fuse(self, maps: list[torch.Tensor]) -> torch.Tensor:
        size = max((tuple(m.shape[-2:]) for m in maps), key=lambda s: s[0] * s[1])
        scaled = [_maps.minmax(_maps.upsample(m, size)) for m in maps]
        return _maps.minmax(torch.stack(scaled).mean(dim=0))

    def _run(self, inputs: Any, target: Target, *, with_grad: bool) -> tuple[dict[str, list[torch.Tensor]], Any]:
        """One forward capturing every call's output of every target layer; the graph starts at the first capture.

        With gradients, returns ``{name: [activation, gradient]}`` of the chosen call of each layer; without, every
        call's activation.
        """
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in self.layers}
        with HookedRun(self.model, type(self).__name__, with_grad=with_grad) as run:

            def capture(module: nn.Module, args: Any, output: Any, *, name: str) -> Any:
                tensor = output[0] if isinstance(output, (tuple, list)) else output
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    keys = f" with entries {list(output)}" if isinstance(output, dict) else ""
                    raise SiteTypeError(
                        f"`layer` {name!r} returned {type(output).__name__}{keys}; CAMs need a floating-point tensor "
                        "output (or a tuple whose first element is one): name a submodule that returns one"
                    )
                if tensor._base is not None or any(tensor is a for a in args):
                    tensor = tensor.clone()  # a view of (or the same tensor as) an input the caller may change in place
                tensor = run.leaf(tensor)
                captured[name].append(tensor)
                replacement = tensor.clone()  # what runs on is a copy: later in-place ops must not touch the capture
                if isinstance(output, (tuple, list)):
                    return type(output)([replacement, *output[1:]])
                return replacement

            run.group.forward(self.layers, capture)
            output = run.forward(inputs)
            for name, calls in captured.items():
                if not calls:
                    raise did_not_run("`layer`", name)
            if not with_grad:
                return {n: [a.detach() for a in calls] for n, calls in captured.items()}, output
            scores = target_scores(output, target, batch_size(inputs))
            chosen = self._chosen(captured)
            grads = run.gradients(scores, [chosen[n] for n in self.layers], "`layer`", self.layers)
            result = {}
            for name, grad in zip(self.layers, grads, strict=True):
                if grad is None:
                    raise no_dependence("`layer`", name, scores, checkpointed=run.checkpointed)
                result[name] = [chosen[name].detach(), grad]
            return result, output

    def _chosen(self, captured: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        chosen = {}
        for name, calls in captured.items():
            if self.call is None:
                if len(calls) > 1:
                    warn(
                        f"`layer` {name!r} ran {len(calls)} times in one forward; using its last call. Pass call=i "
                        f"(0..{len(calls) - 1}) to choose"
                    )
                chosen[name] = calls[-1]
            else:
                if not -len(calls) <= self.call < len(calls):
                    raise ValueError(
                        f"`call`={self.call}, but `layer` {name!r} ran {len(calls)} time(s) in one forward"
                    )
                chosen[name] = calls[self.call]
        return chosen

    def _grid(self, x: torch.Tensor, name: str, size: tuple[int, int] | None, *, check: bool = True) -> torch.Tensor:
        """The layer output as ``(batch, channels, h, w)``; warns when it looks channels-last or is one cell."""
        if check and self.reshape is None and x.dim() == 4 and _looks_channels_last(tuple(x.shape), size):
            warn(
                f"`layer` {name!r} returned {tuple(x.shape)}, which looks channels-last (batch, h, w, channels), as "
                "Swin stages are: read as channels-first, the map would be stripes. Pass reshape='b h w c -> b c h w'"
            )
        grid = _maps.to_grid(x, self.prefix_tokens, self.reshape)
        if check and tuple(grid.shape[-2:]) == (1, 1):
            warn(
                f"`layer` {name!r} has a 1x1 grid {tuple(grid.shape)}: its map is one value per image, all zeros once "
                "min-max scaled. Choose the last layer that still has a spatial grid (before global pooling, e.g. "
                "'layer4' rather than 'avgpool')"
            )
        return grid

    def _raw_maps(self, inputs: Any, target: Target, size: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        captured, output = self._run(inputs, target, with_grad=True)
        maps = {}
        for name, (acts, grads) in captured.items():
            grid_acts = _maps.at_least_float32(self._grid(acts, name, size))
            grid_grads = _maps.at_least_float32(self._grid(grads, name, size, check=False))
            bad = _nonfinite_items(output, grid_acts, grid_grads)
            zero = [i for i in self._check_gradients(name, grads, grid_grads) if i not in bad]
            weights = self._weights(grid_acts, grid_grads)
            maps[name] = cm.combine(weights, grid_acts)
            self._check_degenerate(name, maps[name], cm.term_scale(weights, grid_acts), zero + bad)
            if bad:
                maps[name][bad] = float("nan")
                warn(
                    f"the output, activations or gradients at `layer` {name!r} hold NaN or inf for {items(bad)}: "
                    "their maps are NaN. Check those inputs (torch.isfinite(images).all()) and the model's "
                    "numerics (half-precision overflow)"
                )
        return maps

    def _check_gradients(self, name: str, grads: torch.Tensor, grid: torch.Tensor) -> list[int]:
        """Warn about items whose gradient at the layer's grid is all zero (their maps are); return those items."""
        zero = (grid.flatten(1).abs().amax(1) == 0).nonzero().flatten().tolist()
        if not zero:
            return []
        message = (
            f"the gradient of the target score at `layer` {name!r} is zero for {items(zero)}: the map is all zeros. "
        )
        everywhere = grads.flatten(1)[zero].abs().amax(1) == 0
        if grads.dim() == 3 and not bool(everywhere.all()):
            suggested = _suggest_layers(self.model, name, before_mixing=True)
            message += (
                "This is a token layer after the last token mixing: the head reads only the class token, so the "
                "patch tokens get no gradient. Name a layer before the last token mixing (attention)"
                + (", e.g. " + " or ".join(repr(n) for n in suggested) if suggested else "")
            )
        elif output_ignores_input(self.model):
            message += ZERO_HEAD
        else:
            message += (
                "The score does not use this layer's output for them (a branch the output ignores, a target that "
                "matched nothing, a ReLU that cut everything): choose a layer on the path to the score"
            )
        warn(message)
        return zero

    def _check_degenerate(self, name: str, maps: torch.Tensor, scale: torch.Tensor, skip: list[int]) -> None:
        """Warn about items whose map is all zero or tiny next to its largest term (cancellation), once per cause."""
        peak = maps.flatten(1).amax(1)
        tiny = [i for i in range(len(peak)) if i not in skip and bool(peak[i] < _DEGENERATE * scale[i])]
        zero = [i for i in tiny if peak[i] == 0]
        cancelled = [i for i in tiny if peak[i] != 0]
        suggested = _suggest_layers(self.model, name, before_mixing=False)
        fix = ("Choose " + " or ".join(repr(n) for n in suggested)) if suggested else "Choose another layer"
        method = type(self).__name__
        if zero:
            warn(
                f"the {method} map at `layer` {name!r} is all zero for {items(zero)}: every position's weighted sum "
                "is negative, so ReLU leaves nothing; at this layer the evidence is against the target. "
                f"{fix}, or check the target"
            )
        if cancelled:
            warn(
                f"the {method} map at `layer` {name!r} is degenerate for {items(cancelled)}: "
                f"{float(peak[cancelled].max()):.1e} at most, below {_DEGENERATE:g} of its largest weight x "
                f"activation term ({float(scale[cancelled].max()):.1e}), so it shows rounding, not evidence: the "
                "terms cancel (a block output that feeds a LayerNorm: the norm removes the gradient's component "
                f"along the activation). {fix}"
            )

    def _weights(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """The method's weights of the activations: per channel ``(b, k, 1, 1)`` or per position ``(b, k, h, w)``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, layers={self.layers})"


def _looks_channels_last(shape: tuple[int, ...], size: tuple[int, int] | None) -> bool:
    """Whether ``(b, d1, d2, d3)`` is more likely ``(b, h, w, c)`` than ``(b, c, h, w)``.

    That is: ``(d1, d2)`` has the image's aspect ratio (a square without an image) and ``(d2, d3)`` does not.
    """
    _, d1, d2, d3 = shape
    aspect = size[0] / size[1] if size is not None else 1.0

    def fits(h: int, w: int) -> bool:
        return abs(math.log(h / w) - math.log(aspect)) < 0.25 if h > 0 and w > 0 else False

    return fits(d1, d2) and not fits(d2, d3)


def _nonfinite_items(output: Any, *tensors: torch.Tensor) -> list[int]:
    """The batch items whose logits, activations or gradients hold NaN or inf."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    batch = tensors[0].shape[0]
    checked = [t for t in (logits, *tensors) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch]
    bad = torch.zeros(batch, dtype=torch.bool)
    for t in checked:
        if t.is_floating_point():
            bad |= (~torch.isfinite(t.detach())).flatten(1).any(1).cpu()
    return bad.nonzero().flatten().tolist()


def _suggest_layers(model: nn.Module, name: str, *, before_mixing: bool) -> list[str]:
    """Existing layers that give a meaningful map instead of ``name``: a transformer block's first norm and MLP.

    The block is ``name`` or its nearest ancestor with an attention child (the last block when ``name`` is after
    the last token mixing): its first norm (the block's input, before its token mixing) and its MLP, or the
    previous block's MLP for the last block, whose own MLP comes after the last mixing.
    """
    modules = dict(model.named_modules())
    blocks = [n for n, m in modules.items() if any(_is_attention(c) for c, _ in m.named_children())]
    ancestors = [n for n in blocks if name == n or name.startswith(f"{n}.")]
    if not ancestors and not (before_mixing and blocks):
        return []
    block = blocks[-1] if before_mixing else ancestors[-1]
    # the last block's MLP runs after the last token mixing: its patch tokens get no gradient
    mlp_block: str | None = block if block != blocks[-1] else (blocks[-2] if len(blocks) > 1 else None)
    found = [_child_like(modules, block, "norm"), _child_like(modules, mlp_block, "mlp") if mlp_block else None]
    return [n for n in found if n is not None and n != name]


def _is_attention(child: str) -> bool:
    """A child name that is a block's attention (``attn``, ``self_attn``, ``attention``, ``self_attention``)."""
    return re.fullmatch(r"(self_?)?(attn|attention)\d*", child.lower()) is not None


def _child_like(modules: dict[str, nn.Module], block: str, kind: str) -> str | None:
    """The block's first child whose name says it is a ``norm`` (or ``ln_*``) or an ``mlp``."""
    for child, _ in modules[block].named_children():
        low = child.lower()
        if kind in low or (kind == "norm" and low.startswith("ln")):
            return f"{block}.{child}"
    return None
