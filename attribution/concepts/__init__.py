"""Concepts: concept activation vectors (CAVs) and TCAV with its significance test.

A CAV (Kim et al. 2018, https://arxiv.org/abs/1711.11279) is the direction in a layer's flattened activations that
separates a concept's examples from counterexamples; TCAV asks how often the target's gradient at that layer points
along it, over several counterexample sets, and whether that differs from what random-vs-random CAVs give (a
two-sided t-test, Bonferroni-corrected over concepts and layers). Activations are recorded and classifiers fitted on
the model's device, with torch alone.
"""

from .cav import CAV, cav
from .tcav import TCAV, ConceptScore, TCAVResult

__all__ = ["CAV", "ConceptScore", "TCAV", "TCAVResult", "cav"]
