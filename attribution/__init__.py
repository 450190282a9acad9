"""Attribution methods built on :mod:`hooks`: each call registers and removes its own hook group.

Every method family lives in its own folder (``cam/``, ``rollout/``, ``patching/``, ``features/``, ``datasets/``) and
every explainer is importable from here by its own name. The evaluation metrics (:mod:`attribution.metrics`), the
plots (:mod:`attribution.plot`) and the target helpers (:mod:`attribution.targets`) keep their own namespaces.

Example:
    >>> import torch, torchvision
    >>> from attribution import GradCAM
    >>> model = torchvision.models.resnet18(weights=None).eval()
    >>> saliency = GradCAM(model, "layer4")(torch.randn(1, 3, 64, 64))
    >>> saliency.shape, float(saliency.min()) >= 0, float(saliency.max()) <= 1
    (torch.Size([1, 64, 64]), True, True)
"""

import sys

from . import targets as targets  # the target helpers keep their namespace
from .cam import AblationCAM, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from .causal import (
    BoundlessSubspace,
    CausalModel,
    Interchange,
    InterventionSweep,
    LowRankSubspace,
    RotatedSubspace,
    Site,
    interchange,
    interchange_intervention_accuracy,
    intervention_sweep,
    train_intervention,
)
from .circuits import (
    Circuit,
    EdgeScores,
    edge_attribution,
    evaluate,
    exact_edge_effects,
    faithfulness,
    faithfulness_curve,
)
from .concepts import CAV, TCAV, TCAVResult, cav
from .datasets import aggregate as _aggregate
from .datasets import attribute_dataset, class_means, mean_patching, open_results
from .datasets import runner as _runner
from .dictionaries import (
    SAE,
    Transcoder,
    ablate_direction,
    diff_means,
    evaluate_dictionary,
    load_dictionary,
    splice,
    steer,
    train_dictionary,
)
from .features import Directions, Features, Heads, Neurons, UnitReport, dashboard, explain, feature_statistics, score
from .generation import GenerationAttribution, attribute_generation
from .gradients import (
    Deconvolution,
    GuidedBackprop,
    GuidedGradCAM,
    InputXGradient,
    IntegratedGradients,
    InternalInfluence,
    LayerConductance,
    NeuronConductance,
    NeuronGradient,
    NeuronGuidedBackprop,
    NeuronIntegratedGradients,
    Saliency,
    SmoothGrad,
)
from .graphs import AttributionGraph, attribution_graph
from .influence import (
    InfluenceFunction,
    RandomProjection,
    TracIn,
    linear_datamodeling_score,
    per_example_gradients,
    retrain_on_subsets,
)
from .lens import DirectLogitAttribution, direct_logit_attribution, logit_lens
from .lrp import LRP, AttnLRP
from .patching import Patch, activation_patching, attribution_patching, patch, path_patching, record
from .patching import attribution as _attribution_patching
from .patching import path as _path_patching
from .perturbation import (
    LIME,
    RISE,
    FeatureAblation,
    KernelSHAP,
    NeuronFeatureAblation,
    Occlusion,
    ShapleyValues,
    ShapleyValueSampling,
)
from .probes import ProbeResult, causal_check, probe
from .reference import DeepLift, DeepLiftShap, GradientShap, NeuronDeepLift
from .robust import fgsm, min_perturbation, pgd
from .rollout import AttentionRollout, GradientRollout

# The modules' paths before the family folders, which the docs and existing code name: the same module objects,
# registered under the old names. No file of those names exists, so importing one never sets an attribute of this
# package (``attribution.attribution_patching`` stays the function).
sys.modules[f"{__name__}.attribution_patching"] = _attribution_patching
sys.modules[f"{__name__}.path_patching"] = _path_patching
sys.modules[f"{__name__}.dataset"] = _runner
sys.modules[f"{__name__}.aggregate"] = _aggregate
dataset, aggregate = _runner, _aggregate  # ``import attribution.dataset`` then ``attribution.dataset.x``

__all__ = [
    "BoundlessSubspace",
    "CausalModel",
    "Interchange",
    "InterventionSweep",
    "LowRankSubspace",
    "RotatedSubspace",
    "Site",
    "interchange",
    "interchange_intervention_accuracy",
    "intervention_sweep",
    "train_intervention",
    "AblationCAM",
    "CAV",
    "TCAV",
    "TCAVResult",
    "cav",
    "AttentionRollout",
    "AttnLRP",
    "AttributionGraph",
    "Circuit",
    "Deconvolution",
    "DeepLift",
    "DeepLiftShap",
    "DirectLogitAttribution",
    "Directions",
    "EdgeScores",
    "EigenCAM",
    "FeatureAblation",
    "Features",
    "GenerationAttribution",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradientRollout",
    "GradientShap",
    "GuidedBackprop",
    "GuidedGradCAM",
    "Heads",
    "HiResCAM",
    "InfluenceFunction",
    "InputXGradient",
    "IntegratedGradients",
    "InternalInfluence",
    "KernelSHAP",
    "LIME",
    "LRP",
    "LayerCAM",
    "LayerConductance",
    "NeuronConductance",
    "NeuronDeepLift",
    "NeuronFeatureAblation",
    "NeuronGradient",
    "NeuronGuidedBackprop",
    "NeuronIntegratedGradients",
    "Neurons",
    "Occlusion",
    "Patch",
    "ProbeResult",
    "RISE",
    "RandomProjection",
    "SAE",
    "Saliency",
    "ScoreCAM",
    "ShapleyValueSampling",
    "ShapleyValues",
    "SmoothGrad",
    "Transcoder",
    "TracIn",
    "UnitReport",
    "XGradCAM",
    "ablate_direction",
    "activation_patching",
    "attribute_dataset",
    "attribute_generation",
    "attribution_graph",
    "attribution_patching",
    "causal_check",
    "class_means",
    "dashboard",
    "diff_means",
    "direct_logit_attribution",
    "edge_attribution",
    "evaluate",
    "evaluate_dictionary",
    "exact_edge_effects",
    "explain",
    "faithfulness",
    "faithfulness_curve",
    "feature_statistics",
    "fgsm",
    "linear_datamodeling_score",
    "load_dictionary",
    "logit_lens",
    "mean_patching",
    "min_perturbation",
    "open_results",
    "patch",
    "path_patching",
    "per_example_gradients",
    "pgd",
    "probe",
    "record",
    "retrain_on_subsets",
    "score",
    "splice",
    "steer",
    "train_dictionary",
]
