"""Trained interventions (DAS, Boundless DAS, low rank) and interchange intervention accuracy, on the patching kernel.

An intervention is a module ``f(base, source)`` applied at a :class:`Site`: :class:`Interchange` (the plain swap),
:class:`RotatedSubspace` (``R^T swap_k(R b, R s)``), :class:`BoundlessSubspace` (a learned soft boundary),
:class:`LowRankSubspace` (``b + (R_k s - R_k b) R_k``). :func:`interchange` runs a model with interventions;
:func:`train_intervention` trains one (the model frozen) and :func:`interchange_intervention_accuracy` scores it;
:func:`intervention_sweep` trains and scores one per site and subspace size, as a labelled table with a heatmap.
"""

from ._model import CausalModel
from .interchange import interchange
from .interventions import BoundlessSubspace, Interchange, LowRankSubspace, RotatedSubspace
from .site import Site
from .sweep import InterventionSweep, intervention_sweep
from .train import interchange_intervention_accuracy, train_intervention

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
]
