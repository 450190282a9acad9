"""Perturbation methods on generated text: each generated token's log-probability as the prompt's tokens are removed.

The target is captum's ``LLMAttribution``'s: generated token ``i`` scores ``log p(g_i | prompt, g_0 .. g_{i-1})`` of
the teacher-forced sequence (:class:`attribution.perturbation.Continuation`); the features are the prompt's tokens,
each replaced by ``baseline_token`` when it is left out. All prompts of a batch share the perturbations and the
model calls, and the unperturbed prefix's keys/values are reused where the model takes a cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ..perturbation import LIME, Continuation, FeatureAblation, KernelSHAP, ShapleyValueSampling

PERTURBATION_METHODS = ("feature_ablation", "shapley_sampling", "kernel_shap", "lime")


def perturbation_scores(
    model: nn.Module,
    prompts: torch.Tensor,
    generated: torch.Tensor,
    method: str,
    baseline_token: int,
    samples: int | None,
    seed: int,
) -> torch.Tensor:
    """``(B, N, P + N)``: each generated token's attribution to the prompt's tokens, zero on the generated ones."""
    options: dict = {"baseline": baseline_token, "show_progress": False}
    if method == "feature_ablation":
        explainer: FeatureAblation | ShapleyValueSampling | KernelSHAP | LIME = FeatureAblation(model, **options)
    elif method == "shapley_sampling":
        explainer = ShapleyValueSampling(model, samples=25 if samples is None else samples, seed=seed, **options)
    elif method == "kernel_shap":
        explainer = KernelSHAP(model, samples=samples, seed=seed, **options)
    else:
        explainer = LIME(model, samples=50 if samples is None else samples, seed=seed, **options)
    attributions = explainer(prompts, target=Continuation(generated))  # (B, N, P)
    return torch.cat([attributions, attributions.new_zeros(*generated.shape, generated.shape[1])], -1)
