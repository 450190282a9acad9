"""Probes: classifiers on a model's activations, their control task (selectivity) and the causal check beside them.

A probe's accuracy says that a property can be read from a site; it does not say the model reads it there. Every
:class:`ProbeResult` carries the control task's accuracy (Hewitt & Liang 2019) and a direction for
:func:`causal_check`, which measures what the model's own behaviour does when that direction is removed or pushed.
"""

from .causal import causal_check
from .probe import ProbeResult, probe

__all__ = ["ProbeResult", "causal_check", "probe"]
