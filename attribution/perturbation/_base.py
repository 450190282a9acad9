"""What every perturbation method shares: the model, the baseline, the feature mask and how perturbations are run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._inputs import batched
from .._run import eager_module
from ..targets import Target
from ._continuation import Continuation
from ._evaluate import Evaluator
from ._layer import check_layer
from ._masks import Baseline, feature_ids


class PerturbationMethod:
    """A perturbation method built with a model; called with ``(inputs, target=...)``.

    Args:
        model: the network; for language models a HuggingFace causal LM taking token ids ``(batch, T)``.
        baseline: what perturbed elements become: ``None`` (0; for token ids the model config's ``pad_token_id``,
            else ``eos_token_id``, else 0), a number, a tensor like one item or the batch, or a callable
            ``inputs -> baseline``.
        feature_mask: ``None`` (one feature per element: per token for token ids) or an integer tensor broadcastable
            to one item whose equal ids form one feature, ids ``0..M-1``.
        perturbations_per_forward: perturbations per model call (each one row per item); ``None``: as many as fit
            a memory budget; ``1`` is captum's default.
        reuse: for causal language models that take ``past_key_values``: run only the positions from a
            perturbation's first change on, on the unperturbed keys/values of the positions before it (exact).
        show_progress: a progress bar for calls that take more than a second.
        layer: ``None`` (perturb the inputs) or one module (its name, or the module) whose output is perturbed
            instead: the feature mask, window and baseline then apply to one item of that output, and only what
            follows the layer runs per perturbation batch (see ``_layer.py``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        baseline: Baseline = None,
        feature_mask: torch.Tensor | None = None,
        perturbations_per_forward: int | None = None,
        reuse: bool = True,
        show_progress: bool = True,
        layer: str | nn.Module | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        per = perturbations_per_forward
        if per is not None and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
            raise ValueError(f"`perturbations_per_forward` must be None or an integer >= 1; got {per!r}")
        self.model = eager_module(model)
        self.layer = check_layer(self.model, layer, type(self).__name__)
        self.baseline = baseline
        self.feature_mask = feature_mask
        self.perturbations_per_forward = per
        self.reuse = reuse
        self.show_progress = show_progress
        self.forwards = 0  # the model calls of the last call (the cost model of docs/methods/perturbation.rst)

    def _inputs(self, inputs: Any) -> tuple[torch.Tensor, bool]:
        """``inputs`` checked: a tensor with a batch axis (a single image gets one); uint8 images refused."""
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__} takes `inputs` as one tensor (batch, ...); got {type(inputs).__name__}"
            )
        given = batched(inputs, self.model, images=False)
        x = given.inputs
        if x.dim() < 2:
            raise ValueError(f"`inputs` must be (batch, ...) with at least one axis per item; got {tuple(x.shape)}")
        return x, given.single

    def _features(self, units: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The feature of every element of an item (of the inputs or the layer's output) and the number of features."""
        try:
            ids, count = feature_ids(self.feature_mask, units.shape[1:])
        except ValueError as exc:
            if self.layer is None:
                raise
            raise ValueError(f"{exc} (the item is one item of the output of `layer` {self.layer!r})") from None
        return ids.to(units.device), count

    def _evaluator(self, x: torch.Tensor, target: Target | Continuation) -> Evaluator:
        return Evaluator(
            self.model,
            type(self).__name__,
            x,
            target,
            self.baseline,
            per_forward=self.perturbations_per_forward,
            reuse=self.reuse,
            show_progress=self.show_progress,
            layer=self.layer,
        )

    def __repr__(self) -> str:
        where = "" if self.layer is None else f", layer={self.layer!r}"
        return f"{type(self).__name__}({type(self.model).__name__}{where})"
