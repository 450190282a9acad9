"""The CAMs without gradients: Eigen-CAM (a principal direction) and Score-CAM (masked forwards)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _maps
from .._progress import progress as progress_bar
from .._run import kept_state
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
        progress: show a tqdm progress bar.
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
