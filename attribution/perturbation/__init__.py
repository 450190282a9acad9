"""Perturbation attributions: Occlusion, feature ablation, Shapley values, KernelSHAP, LIME, RISE.

No gradients: every method runs the model on perturbed copies of the inputs, the elements of a feature (equal ids of
``feature_mask``, captum's convention) set to a ``baseline``, and attributes the change of the target score. Every
method is built with the model and its settings and called with ``(inputs, target=...)``; it returns attributions
shaped like ``inputs``, batch first. Inputs are floating-point tensors ``(batch, ...)`` or, for HuggingFace causal
language models, token ids ``(batch, T)`` (an integer target is then the log-probability of that token at the last
position; the baseline token defaults to the config's ``pad_token_id``, else ``eos_token_id``, else 0).

All methods run perturbations through one evaluator (``_evaluate.py``): batched ``perturbations_per_forward`` at a
time (default: as many as fit a memory budget), the model left as found, and for causal language models the
unperturbed prefix's keys/values reused by every perturbation that starts later (``reuse=True``; exact). See
``docs/methods/perturbation.rst`` for the definitions, the conventions that differ from captum and shap, and the
cost of each method.
"""

from ._continuation import Continuation
from .ablation import FeatureAblation
from .kernel_shap import KernelSHAP
from .lime import LIME
from .neuron_ablation import NeuronFeatureAblation
from .occlusion import Occlusion
from .rise import RISE
from .shapley import ShapleyValues, ShapleyValueSampling

Continuation.__module__ = __name__  # documented (and named in signatures) as attribution.perturbation.Continuation

__all__ = [
    "LIME",
    "RISE",
    "Continuation",
    "FeatureAblation",
    "KernelSHAP",
    "NeuronFeatureAblation",
    "Occlusion",
    "ShapleyValueSampling",
    "ShapleyValues",
]
