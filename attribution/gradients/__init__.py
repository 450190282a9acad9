"""Gradient attributions: Saliency, Input x Gradient, Integrated Gradients, SmoothGrad, Guided Backprop, ...

Every method is built with the model (and a layer where it has one) and called with ``(inputs, target=...)``
(:mod:`attribution.targets` semantics); it returns raw attributions shaped like ``inputs``, batch first, neither
summed over channels nor normalised. Every call registers and removes its own hook group and leaves the model as it
found it. See ``docs/methods/gradients.rst`` for the formulas and the correspondence with captum.
"""

from .conductance import InternalInfluence, LayerConductance
from .guided import Deconvolution, GuidedBackprop
from .guided_gradcam import GuidedGradCAM
from .integrated import IntegratedGradients
from .neuron import NeuronGradient
from .neuron_guided import NeuronGuidedBackprop
from .neuron_path import NeuronConductance, NeuronIntegratedGradients
from .saliency import InputXGradient, Saliency
from .smoothgrad import SmoothGrad

__all__ = [
    "Deconvolution",
    "GuidedBackprop",
    "GuidedGradCAM",
    "InputXGradient",
    "IntegratedGradients",
    "InternalInfluence",
    "LayerConductance",
    "NeuronConductance",
    "NeuronGradient",
    "NeuronGuidedBackprop",
    "NeuronIntegratedGradients",
    "Saliency",
    "SmoothGrad",
]
