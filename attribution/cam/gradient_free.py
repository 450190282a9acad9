"""The CAMs without gradients: Eigen-CAM (a principal direction), Score-CAM (masked forwards), Ablation-CAM."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _maps
from .._progress import progress as progress_bar
from .._run import HookedRun, SiteValueError, kept_state, warn
from ..perturbation import FeatureAblation
from ..targets import Target, class_indices, class_logits
from . import _math as cm
from ._base import CAM, Layers, Reshape


class EigenCAM(CAM):
    """Eigen-CAM (Muhammad & Yeasin, 2020, https://arxiv.org/abs/2008.00299): no gradients, no target.

    ``L = ReLU(O v_1)`` where ``O`` is the ``(positions, channels)`` activation matrix (uncentred, as in the paper)
    and ``v_1`` its first right singular vector, signed so that the projection sums to a non-negative value.
    ``target`` is ignored. Same arguments as :class:`GradCAM`.
    """

    uses_gradients = False

    def _raw_maps(self, inputs: Any, target: Target, size: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        captured, _ = self._run(inputs, None, with_grad=False)
        chosen = self._chosen(captured)
        return {
            name: cm.eigencam(_maps.at_least_float32(self._grid(acts, name, size))) for name, acts in chosen.items()
        }


class ScoreCAM(CAM):
    """Score-CAM (Wang et al., 2020, https://arxiv.org/abs/1910.01279): weights from masked forwards, no gradients.

    For each channel ``k``: the activation map ``A_k`` is upsampled to the input size and min-max scaled to a mask
    ``H_k``; the weight is the target's softmax probability on the masked input, ``w_k = softmax(f(X * H_k))_c``
    (as the authors' code; for a callable target, its score on the masked input). ``L = ReLU(sum_k w_k A_k)``.
    The masked inputs run in batches of ``batch_size``, without autograd; ``progress=False`` hides the progress bar.

    Args:
        model: the network.
        layers: the layer(s), as for :class:`GradCAM`.
        layer: exactly one layer by keyword, as for :class:`GradCAM`.
        batch_size: masked inputs per forward.
        progress: show a tqdm progress bar on a terminal.
        reshape: as for :class:`GradCAM`.
        call: as for :class:`GradCAM`.
    """

    uses_gradients = False

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        layer: Layers | None = None,
        batch_size: int = 32,
        progress: bool = True,
        reshape: Reshape = None,
        call: int | None = None,
    ) -> None:
        super().__init__(model, layers, layer=layer, reshape=reshape, call=call)
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1; got {batch_size}")
        self.batch_size = batch_size
        self.progress = progress

    def _raw_maps(self, inputs: Any, target: Target, size: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            raise TypeError(
                "Score-CAM masks the input image: `inputs` must be an image tensor (B, C, H, W) or (C, H, W); got "
                f"{type(inputs).__name__}"
            )
        batch = inputs
        captured, output = self._run(batch, None, with_grad=False)
        chosen = {name: _maps.at_least_float32(self._grid(a, name, size)) for name, a in self._chosen(captured).items()}
        index = None if callable(target) else class_indices(class_logits(output), target, batch.shape[0])
        maps = {}
        assert size is not None
        with kept_state(self.model), torch.no_grad():
            for name, acts in chosen.items():
                b, k = acts.shape[:2]
                weights = torch.empty(b, k, dtype=acts.dtype)
                steps = [(i, j) for i in range(b) for j in range(0, k, self.batch_size)]
                for i, j in progress_bar(steps, desc=f"Score-CAM {name}", enabled=self.progress):
                    masks = _maps.minmax(_maps.upsample(acts[i, j : j + self.batch_size], size))  # built chunk by chunk
                    out = self.model(masks[:, None].to(batch.dtype) * batch[i : i + 1])
                    if index is None:
                        assert callable(target)
                        scores = target(out)
                    else:
                        scores = class_logits(out).softmax(dim=1)[:, index[i]]
                    weights[i, j : j + masks.shape[0]] = scores.to(weights.dtype).cpu()
                maps[name] = cm.weighted(acts, weights.to(acts.device))
        return maps


class AblationCAM(CAM):
    """Ablation-CAM (Desai & Ramaswamy, 2020, https://doi.org/10.1109/WACV45572.2020.9093360), as pytorch-grad-cam.

    For each channel ``k`` of the layer's output ``A``: ``y_k``, the target score with channel ``k`` set to zero, and
    the weight ``w_k = (y - y_k) / y`` (``y`` the target score); ``L = ReLU(sum_k w_k A_k)``. The channels are
    ablated ``batch_size`` at a time. For a layer the model calls once this is
    :class:`~attribution.FeatureAblation` at the layer with one feature per channel: the model runs up
    to the layer once, and only what follows it runs on the ablated copies (pytorch-grad-cam runs the whole model on
    every batch). For a layer called several times (``call=``), the item runs up to the layer once per batch of
    channels at batch size 1, and the chosen call's output is replaced by the ablated copies; modules after the
    layer that read a tensor from before it see it at batch size 1 and broadcast, and a model whose later code
    cannot broadcast raises. No gradients. ``progress=False`` hides the progress bar.

    pytorch-grad-cam zeroes the channel only when the layer's output has 0 as its minimum (after a ReLU) and sets it
    to ``min - 1e7`` otherwise; here it is always zeroed, the paper's definition. Where ``y = 0`` the weights are
    undefined: that item's map is NaN, with a warning.

    Args:
        model: the network.
        layers: the layer(s), as for :class:`GradCAM`; each must return ``(batch, channels, h, w)``.
        layer: exactly one layer by keyword, as for :class:`GradCAM`.
        batch_size: ablated channels per forward.
        progress: show a tqdm progress bar on a terminal.
        call: as for :class:`GradCAM`.

    Example:
        >>> import torch, torchvision
        >>> from attribution import AblationCAM
        >>> model = torchvision.models.resnet18(weights=None).eval()
        >>> AblationCAM(model, "layer4", progress=False)(torch.randn(1, 3, 64, 64), target=3).shape
        torch.Size([1, 64, 64])
    """

    uses_gradients = False

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        layer: Layers | None = None,
        batch_size: int = 32,
        progress: bool = True,
        call: int | None = None,
    ) -> None:
        super().__init__(model, layers, layer=layer, call=call)
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1; got {batch_size}")
        self.batch_size = batch_size
        self.progress = progress

    def _raw_maps(self, inputs: Any, target: Target, size: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            raise TypeError(
                "Ablation-CAM runs the model on one image at a time: `inputs` must be an image tensor (B, C, H, W) or "
                f"(C, H, W); got {type(inputs).__name__}"
            )
        captured, output = self._run(inputs, None, with_grad=False)
        index = None if callable(target) else class_indices(class_logits(output), target, inputs.shape[0])
        score = _scores(output, target, index, slice(None)).to(torch.float64)
        maps = {}
        for name, calls in captured.items():
            which = (self.call if self.call is not None else -1) % len(calls)
            acts = calls[which]
            if acts.dim() != 4:
                raise SiteValueError(
                    f"`layer` {name!r} returned {tuple(acts.shape)}; Ablation-CAM zeroes channels of a (batch, "
                    "channels, h, w) output: choose a convolutional layer"
                )
            ablated = self._ablated_scores(inputs, name, which, acts, target, index, len(calls), score)
            weights = cm.ablation_weights(score, ablated)
            maps[name] = cm.weighted(_maps.at_least_float32(acts), weights.to(_maps.at_least_float32(acts).dtype))
            zero = (score == 0).nonzero().flatten().tolist()
            if zero:
                maps[name][zero] = float("nan")
                warn(
                    f"Ablation-CAM: the target score is 0 for items {zero}: the weights (y - y_k) / y, and so their "
                    "maps, are NaN. Choose another target"
                )
        return maps

    def _ablated_scores(
        self,
        inputs: torch.Tensor,
        name: str,
        which: int,
        acts: torch.Tensor,
        target: Target,
        index: Any,
        calls: int,
        score: torch.Tensor,
    ) -> torch.Tensor:
        """``y_k`` of every item and channel, ``(batch, channels)``.

        A layer called once: :class:`~attribution.perturbation.FeatureAblation` at the layer, one feature per channel,
        so the model runs up to the layer once and only what follows runs on the ablated copies. A layer called
        several times: one forward per item and batch of channels, the chosen call's output replaced.
        """
        if calls == 1:
            channels = torch.arange(acts.shape[1], device=acts.device)[:, None, None]
            ablation = FeatureAblation(
                self.model,
                channels,
                0.0,
                perturbations_per_forward=self.batch_size,
                show_progress=self.progress,
                layer=name,
            )
            drop = ablation(inputs, target=target if index is None else index)[:, :, 0, 0]  # y - y_k
            return (score[:, None] - drop.to(torch.float64)).to(acts.device)
        b, k = acts.shape[:2]
        ablated = torch.empty(b, k, dtype=torch.float64)
        rows: list[torch.Tensor] = []

        def replace(module: nn.Module, args: Any, output: Any, *, call: int) -> Any:
            if call != which:
                return None
            return type(output)([rows[0], *output[1:]]) if isinstance(output, (tuple, list)) else rows[0]

        steps = [(i, j) for i in range(b) for j in range(0, k, self.batch_size)]
        with HookedRun(self.model, "AblationCAM") as run:
            run.group.forward(name, replace)
            for i, j in progress_bar(steps, desc=f"Ablation-CAM {name}", enabled=self.progress):
                channels = torch.arange(j, min(j + self.batch_size, k), device=acts.device)
                batch = acts[i : i + 1].repeat(len(channels), 1, 1, 1)
                batch[torch.arange(len(channels), device=acts.device), channels] = 0
                rows[:] = [batch]
                out = run.forward(inputs[i : i + 1])
                scores = _scores(out, target, index, i)
                if scores.shape != (len(channels),):
                    raise SiteValueError(
                        f"Ablation-CAM replaced the output of {name!r} by {len(channels)} ablated copies but the model "
                        f"returned {tuple(scores.shape)} scores: the code after the layer does not broadcast over the "
                        "batch (it keeps the batch size of its input). Choose a layer whose successors only read it"
                    )
                ablated[i, j : j + len(channels)] = scores.to(torch.float64).cpu()
        return ablated.to(acts.device)


def _scores(output: Any, target: Target, index: torch.Tensor | None, item: int | slice) -> torch.Tensor:
    """The target scores of ``output``: the class ``index[item]`` of every row, or a callable target's scores."""
    if index is None:
        assert callable(target)
        return target(output).detach()
    logits = class_logits(output).detach()
    return logits[:, index[item]] if isinstance(item, int) else logits.gather(1, index[:, None])[:, 0]
