"""Reference-based attributions: DeepLift, DeepLiftShap and GradientShap.

Every method is built with the model and its reference(s) and called with ``(inputs, target=...)``
(:mod:`attribution.targets` semantics) on floating-point ``(batch, ...)`` inputs; it returns raw attributions shaped
like ``inputs``, neither summed over channels nor normalised, or with ``return_delta=True`` an
:class:`AttributionsWithDelta`, a pair that unpacks as ``attributions, delta = ...`` (``.delta`` is ``(batch,)``:
``sum(attributions) - (S(x) - S(baseline))``, captum's convergence delta). A baseline is a number, a tensor like the
inputs or one item, or a callable ``inputs -> baseline``; a wrong shape is refused with both shapes named. Every call
registers and removes its own hook group and leaves the model as it found it. See ``docs/methods/reference.rst`` for
the rules and the correspondence with captum.
"""

from .._results import AttributionsWithDelta
from .deeplift import DeepLift, DeepLiftShap
from .gradient_shap import GradientShap, draw
from .neuron_deeplift import NeuronDeepLift

__all__ = ["AttributionsWithDelta", "DeepLift", "DeepLiftShap", "GradientShap", "NeuronDeepLift", "draw"]
