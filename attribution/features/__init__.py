"""What a unit means: MLP neurons, attention heads, dictionary features and directions read over whole datasets.

:func:`feature_statistics` streams documents through the model once (twice with bands) and keeps, per unit, the
exact top examples with their contexts, the distribution's statistics and a quantile sketch, uniform samples in
bands of activating values and of non-activating positions, logit effects and co-activations, in memory that does
not grow with the number of tokens; resumable from a checkpoint and shared across ``torchrun`` processes, whose
parts merge to the one-process :class:`UnitReport` bit for bit. Units are spelled :class:`Neurons`,
:class:`Heads`, :class:`Features` or :class:`Directions`.
"""

from .dashboard import dashboard
from .explanations import Explanation, detection_metrics, explain, score
from .plot import plot_unit
from .report import Example, UnitReport
from .statistics import feature_statistics
from .units import Directions, Features, Heads, Neurons

__all__ = [
    "Directions",
    "Example",
    "Explanation",
    "Features",
    "Heads",
    "Neurons",
    "UnitReport",
    "dashboard",
    "detection_metrics",
    "explain",
    "feature_statistics",
    "plot_unit",
    "score",
]
