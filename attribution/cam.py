"""Grad-CAM and its family, each call registering and removing its own hook group.

Common semantics (every class here):

* ``cam(inputs, target)`` takes ``(B, C, H, W)`` (or ``(C, H, W)``, giving ``(H, W)``) and returns a float tensor
  ``(B, H, W)`` in [0, 1] on the input's device: the map at the layer's resolution, bilinearly upsampled
  (``align_corners=False``) to the input size, then min-max scaled per image (an all-zero map stays zero).
  ``upsample=False`` keeps the layer's resolution; ``normalize=False`` returns the raw map.
* ``target``: ``None`` (each item's top class), an int, a sequence of ints (one per item), or a callable
  ``output -> (B,)`` scores. Class scores are the logits, before any softmax.
* ``layer``: a name, a glob, a module, or a list; with several layers, ``cam(...)`` returns their fused map (the mean
  of the per-layer maps, each upsampled and min-max scaled, then min-max scaled again) and :meth:`layer_maps`
  returns each layer's map.
* The activation used is the layer's true output, recorded before any in-place operation that follows (VGG's
  ``ReLU(inplace=True)``, ResNet's ``out += identity``). When the layer runs several times in one forward, the last
  call is used (with a warning) unless ``call=`` picks one.
* The model is left exactly as it was: train/eval flags, grad mode, ``requires_grad``, every ``.grad``, no hook. The
  call itself runs the model in eval mode, without autograd up to the first target layer (nothing of the
  backbone's graph is kept), and with autograd from there to the output.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from hooks import HookManager, resolve

from . import _cam_math as cm
from ._guard import evaluating
from ._targets import Target, check_target, class_indices, class_logits, target_scores

Reshape = str | Callable[[torch.Tensor], torch.Tensor] | None


class _TargetLayerError(Exception):
    """Raised from inside our hook; converted to a clear error once the forward has unwound."""


class _CAM:
    """Shared machinery: resolve layers, run the model, capture activations (and gradients), build maps."""

    uses_gradients: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module | Sequence[str | nn.Module],
        *,
        reshape: Reshape = None,
        call: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = model
        self.layers = [name for name, _ in resolve(model, layer, what="`layer`")]
        self.reshape = reshape
        self.call = call
        self.prefix_tokens = getattr(model, "num_prefix_tokens", None)  # timm ViTs say how many tokens precede the grid

    # -- public API ------------------------------------------------------------------------------------------
    def __call__(
        self, inputs: torch.Tensor, target: Target = None, *, upsample: bool = True, normalize: bool = True
    ) -> torch.Tensor:
        """Compute the map of ``target`` for ``inputs``; see the module documentation for the exact semantics.

        With several layers the fused map is returned, always scaled to [0, 1] (``normalize`` is ignored).
        """
        several = len(self.layers) > 1
        maps = self.layer_maps(inputs, target, upsample=upsample, normalize=normalize and not several)
        if not several:
            return next(iter(maps.values()))
        return self._fuse(list(maps.values()), inputs)

    def layer_maps(
        self, inputs: torch.Tensor, target: Target = None, *, upsample: bool = True, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        """One map per target layer, by layer name (same options as calling the object)."""
        batch, single = self._check_inputs(inputs)
        check_target(target, batch.shape[0])
        raw = self._raw_maps(batch, target)
        out = {}
        for name, m in raw.items():
            if upsample:
                m = cm.upsample(m, tuple(batch.shape[-2:]))
            if normalize:
                m = cm.minmax(m)
            m = m.to(inputs.device)
            out[name] = m[0] if single else m
        return out

    # -- machinery -------------------------------------------------------------------------------------------
    def _check_inputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"`inputs` must be a tensor (B, C, H, W) or (C, H, W); got {type(inputs).__name__}")
        if inputs.dim() == 3:
            return inputs[None], True
        if inputs.dim() != 4:
            raise ValueError(f"`inputs` must be (B, C, H, W) or (C, H, W); got shape {tuple(inputs.shape)}")
        return inputs, False

    def _fuse(self, maps: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        size = max((tuple(m.shape[-2:]) for m in maps), key=lambda s: s[0] * s[1])
        scaled = [cm.minmax(cm.upsample(m if m.dim() == 3 else m[None], size)) for m in maps]  # raw maps in
        fused = cm.minmax(torch.stack(scaled).mean(dim=0))
        return fused[0] if inputs.dim() == 3 else fused

    def _run(
        self, batch: torch.Tensor, target: Target, *, with_grad: bool
    ) -> tuple[dict[str, list[torch.Tensor]], Any]:
        """One forward capturing every call's output of every target layer; the graph starts at the first capture."""
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in self.layers}
        started = False

        def capture(module: nn.Module, args: Any, output: Any, *, name: str) -> Any:
            nonlocal started
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise _TargetLayerError(
                    f"`layer` {name!r} returned {type(output).__name__}; CAMs need a floating-point tensor output"
                )
            if with_grad and (not started or not tensor.requires_grad):
                # the graph starts at the first capture: nothing before it is kept. A later capture that does not
                # depend on an earlier one (a parallel branch, with frozen parameters) starts its own.
                tensor = tensor.detach().requires_grad_(True)
                torch.set_grad_enabled(True)
                started = True
            captured[name].append(tensor)
            replacement = tensor.clone()  # what runs on is a copy: later in-place ops must not touch the capture
            if isinstance(output, (tuple, list)):
                return type(output)([replacement, *output[1:]])
            return replacement

        with evaluating(self.model), HookManager(self.model) as mgr:
            mgr.group(f"{type(self).__name__}").forward(self.layers, capture)
            torch.set_grad_enabled(False)
            try:
                output = self.model(batch)
            except _TargetLayerError as exc:
                raise ValueError(str(exc)) from None
            except Exception as exc:
                message = f"the model failed on `inputs` of shape {tuple(batch.shape)} ({batch.dtype}): {exc}"
                clearer = _same_kind(exc, message)
                if clearer is None:
                    raise
                raise clearer from exc
            missing = [name for name, calls in captured.items() if not calls]
            if missing:
                raise ValueError(
                    f"`layer` {missing[0]!r} did not run during the forward pass; choose a layer the model calls "
                    "(see hooks.trace(model, inputs))"
                )
            if with_grad:
                scores = target_scores(output, target, batch.shape[0])
                chosen = self._chosen(captured)
                if not scores.requires_grad:
                    raise ValueError(f"the target score does not depend on `layer` {self.layers[0]!r}")
                grads = torch.autograd.grad(scores.sum(), [chosen[n] for n in self.layers], allow_unused=True)
                return {n: [chosen[n].detach(), g] for n, g in zip(self.layers, grads, strict=True)}, output
            return {n: [a.detach() for a in calls] for n, calls in captured.items()}, output

    def _chosen(self, captured: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        chosen = {}
        for name, calls in captured.items():
            if self.call is None:
                if len(calls) > 1:
                    warnings.warn(
                        f"`layer` {name!r} ran {len(calls)} times in one forward; using its last call. Pass call=i "
                        f"(0..{len(calls) - 1}) to choose",
                        stacklevel=4,
                    )
                chosen[name] = calls[-1]
            else:
                if not -len(calls) <= self.call < len(calls):
                    raise ValueError(
                        f"`call`={self.call}, but `layer` {name!r} ran {len(calls)} time(s) in one forward"
                    )
                chosen[name] = calls[self.call]
        return chosen

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        return cm.to_grid(x, self.prefix_tokens, self.reshape)

    def _raw_maps(self, batch: torch.Tensor, target: Target) -> dict[str, torch.Tensor]:
        captured, _ = self._run(batch, target, with_grad=True)
        maps = {}
        for name, (acts, grads) in captured.items():
            if grads is None:
                raise ValueError(f"the target score does not depend on `layer` {name!r}")
            maps[name] = self._map(self._grid(acts).float(), self._grid(grads).float())
        return maps

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, layers={self.layers})"


def _same_kind(exc: Exception, message: str) -> Exception | None:
    """The same exception type with a clearer message, where the type can be built from a message."""
    try:
        return type(exc)(message)
    except Exception:
        return None


class GradCAM(_CAM):
    """Grad-CAM (Selvaraju et al., 2017, https://arxiv.org/abs/1610.02391).

    ``L = ReLU(sum_k a_k A_k)`` with ``a_k = mean_ij dS/dA_kij``: ``A`` the layer's output, ``S`` the target score.

    Args:
        model: the network.
        layer: the layer(s) whose output is explained: a name, glob, module, or list (see the module docs).
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

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.gradcam(acts, grads)


class GradCAMPlusPlus(_CAM):
    """Grad-CAM++ (Chattopadhyay et al., 2018, https://arxiv.org/abs/1710.11063).

    ``L = ReLU(sum_k w_k A_k)``, ``w_k = sum_ij alpha_kij ReLU(g_kij)``,
    ``alpha_kij = g_kij^2 / (2 g_kij^2 + sum_ab A_kab g_kij^3)`` (0 where the denominator is 0), with ``g = dS/dA``:
    the paper's closed form for ``Y = exp(S)``, whose positive factor ``exp(S)`` is dropped. Same arguments as
    :class:`GradCAM`.
    """

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.gradcam_plus_plus(acts, grads)


class XGradCAM(_CAM):
    """XGrad-CAM (Fu et al., 2020, https://arxiv.org/abs/2008.02312).

    ``L = ReLU(sum_k w_k A_k)``, ``w_k = sum_ij (A_kij / sum_ab A_kab) dS/dA_kij``. Same arguments as
    :class:`GradCAM`.
    """

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.xgradcam(acts, grads)


class HiResCAM(_CAM):
    """HiRes-CAM (Draelos & Carin, 2020, https://arxiv.org/abs/2011.08891).

    ``L = ReLU(sum_k dS/dA_k * A_k)``: the gradient is kept per position instead of averaged, so the map shows
    what the score actually used. Same arguments as :class:`GradCAM`.
    """

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.hirescam(acts, grads)


class LayerCAM(_CAM):
    """LayerCAM (Jiang et al., 2021, https://doi.org/10.1109/TIP.2021.3089943).

    ``L = ReLU(sum_k ReLU(dS/dA_k) * A_k)``: position-wise weights, only positive gradients. Works well on shallow
    layers. With several layers, calling the object gives the paper's fusion: each layer's map (upsampled to the
    finest resolution among them) scaled by ``tanh(2 M / max M)``, the elementwise maximum of those, then min-max.
    Same arguments as :class:`GradCAM`.
    """

    def _map(self, acts: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return cm.layercam(acts, grads)

    def _fuse(self, maps: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        """The paper's fusion: each map scaled by ``tanh(2 M / max M)``, then the elementwise maximum."""
        size = max((tuple(m.shape[-2:]) for m in maps), key=lambda s: s[0] * s[1])
        scaled = []
        for m in maps:
            m = cm.upsample(m if m.dim() == 3 else m[None], size)
            top = m.flatten(1).amax(1).clamp(min=1e-12).view(-1, 1, 1)
            scaled.append(torch.tanh(2 * m / top))
        fused = cm.minmax(torch.stack(scaled).amax(dim=0))
        return fused[0] if inputs.dim() == 3 else fused


class EigenCAM(_CAM):
    """Eigen-CAM (Muhammad & Yeasin, 2020, https://arxiv.org/abs/2008.00299): no gradients, no target.

    ``L = ReLU(O v_1)`` where ``O`` is the ``(positions, channels)`` activation matrix (uncentred, as in the paper)
    and ``v_1`` its first right singular vector, signed so that the projection sums to a non-negative value.
    ``target`` is ignored. Same arguments as :class:`GradCAM`.
    """

    uses_gradients = False

    def _raw_maps(self, batch: torch.Tensor, target: Target) -> dict[str, torch.Tensor]:
        captured, _ = self._run(batch, None, with_grad=False)
        chosen = self._chosen(captured)
        return {name: cm.eigencam(self._grid(acts).float()) for name, acts in chosen.items()}


class ScoreCAM(_CAM):
    """Score-CAM (Wang et al., 2020, https://arxiv.org/abs/1910.01279): weights from masked forwards, no gradients.

    For each channel ``k``: the activation map ``A_k`` is upsampled to the input size and min-max scaled to a mask
    ``H_k``; the weight is the target's softmax probability on the masked input, ``w_k = softmax(f(X * H_k))_c``
    (as the authors' code; for a callable target, its score on the masked input). ``L = ReLU(sum_k w_k A_k)``.
    The masked inputs run in batches of ``batch_size``, without autograd; ``progress=False`` hides the progress bar.

    Args:
        model: the network.
        layer: the layer(s), as for :class:`GradCAM`.
        batch_size: masked inputs per forward.
        progress: show a tqdm progress bar.
        reshape: as for :class:`GradCAM`.
        call: as for :class:`GradCAM`.
    """

    uses_gradients = False

    def __init__(
        self,
        model: nn.Module,
        layer: str | nn.Module | Sequence[str | nn.Module],
        *,
        batch_size: int = 32,
        progress: bool = True,
        reshape: Reshape = None,
        call: int | None = None,
    ) -> None:
        super().__init__(model, layer, reshape=reshape, call=call)
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1; got {batch_size}")
        self.batch_size = batch_size
        self.progress = progress

    def _raw_maps(self, batch: torch.Tensor, target: Target) -> dict[str, torch.Tensor]:
        captured, output = self._run(batch, None, with_grad=False)
        chosen = {name: self._grid(a).float() for name, a in self._chosen(captured).items()}
        index = None if callable(target) else class_indices(class_logits(output), target, batch.shape[0])
        size = tuple(batch.shape[-2:])
        maps = {}
        with evaluating(self.model), torch.no_grad():
            for name, acts in chosen.items():
                b, k = acts.shape[:2]
                weights = torch.empty(b, k)
                steps = [(i, j) for i in range(b) for j in range(0, k, self.batch_size)]
                for i, j in tqdm(steps, desc=f"Score-CAM {name}", disable=not self.progress, leave=False):
                    masks = cm.minmax(cm.upsample(acts[i, j : j + self.batch_size], size))  # built chunk by chunk
                    out = self.model(masks[:, None].to(batch.dtype) * batch[i : i + 1])
                    if index is None:
                        assert callable(target)
                        scores = target(out)
                    else:
                        scores = class_logits(out).softmax(dim=1)[:, index[i]]
                    weights[i, j : j + masks.shape[0]] = scores.float().cpu()
                maps[name] = cm.weighted(acts, weights.to(acts.device))
        return maps
