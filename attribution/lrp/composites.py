"""Composites: which rule each layer gets, by layer type, with a special rule for the first layer (zennit's meaning).

Every composite gives elementwise activations (ReLU included, as zennit's ``layer_map_base``) the ``Pass`` rule
unless its ``layer_map`` names their type, average pooling zennit's ``Norm`` rule and batch norms that follow no
convolution or linear layer the ``Pass`` rule (those that follow one are merged into it, see
:mod:`attribution.lrp.canonizers`); max pooling (the winner takes the relevance), dropout, identity and flatten
layers keep their gradient. The first layer is the first convolution or linear layer in
``named_modules()`` order (for :class:`EpsilonGammaBox`, the first convolution).

========================  ===================  ============  ===================
composite                 convolutions         linear        first layer
========================  ===================  ============  ===================
``EpsilonPlus``           ``ZPlus``            ``Epsilon``   (none)
``EpsilonPlusFlat``       ``ZPlus``            ``Epsilon``   ``Flat``
``EpsilonAlpha2Beta1``    ``AlphaBeta(2, 1)``  ``Epsilon``   (none)
``EpsilonGammaBox``       ``Gamma(0.25)``      ``Epsilon``   ``ZBox(low, high)``
========================  ===================  ============  ===================

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                             torch.nn.Linear(4, 2))
    >>> EpsilonPlusFlat().rules(model)
    {'0': Flat(stabilizer=1e-06), '3': Epsilon(epsilon=1e-06)}
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .canonizers import AFFINE, units
from .rules import AlphaBeta, Epsilon, Flat, Gamma, Rule, ZBox, ZPlus

__all__ = ["Composite", "EpsilonAlpha2Beta1", "EpsilonGammaBox", "EpsilonPlus", "EpsilonPlusFlat"]

Types = type[nn.Module] | tuple[type[nn.Module], ...]
LayerMap = Sequence[tuple[Types, Rule]]
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class Composite:
    """A rule per layer type, and optionally another for the first layer of some types.

    Args:
        layer_map: ``[(types, rule), ...]``: a layer gets the rule of the first entry its type matches
            (``isinstance``). ``Pass()`` may be given to any elementwise module type the composites do not know.
        first_map: the same for the first layer (the first module of one of ``first_types``), looked up first.
        first_types: which modules count as layers for "first layer".
        stabilizer: the ``epsilon`` of the ``Norm`` rule on average pools and residual sums.

    Example:
        >>> import torch
        >>> from attribution.lrp import Composite, Epsilon, ZPlus
        >>> composite = Composite([(torch.nn.Conv2d, ZPlus()), (torch.nn.Linear, Epsilon(0.1))])
        >>> composite.rules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        {'0': Epsilon(epsilon=0.1)}
    """

    def __init__(
        self, layer_map: LayerMap, first_map: LayerMap = (), first_types: Types = AFFINE, stabilizer: float = 1e-6
    ) -> None:
        self.layer_map = list(layer_map)
        self.stabilizer = float(stabilizer)
        self.first_map = list(first_map)
        self.first_types = first_types

    def rules(self, model: nn.Module) -> dict[str, Rule]:
        """``{module name: rule}`` for the modules of ``model`` this composite gives a rule."""
        found: dict[str, Rule] = {}
        first_seen = False
        for name, module in units(model):
            rule = None
            if not first_seen and isinstance(module, self.first_types):
                first_seen = True
                rule = next((r for types, r in self.first_map if isinstance(module, types)), None)
            if rule is None:
                rule = next((r for types, r in self.layer_map if isinstance(module, types)), None)
            if rule is not None:
                found[name] = rule
        return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_map={self.layer_map!r}, first_map={self.first_map!r})"


class EpsilonPlus(Composite):
    """``ZPlus`` on convolutions, ``Epsilon`` on linear layers (zennit's ``EpsilonPlus``).

    Args:
        epsilon: the ``Epsilon`` rule's epsilon.
        stabilizer: the other rules' stabiliser.
        layer_map: entries looked up before the composite's own (e.g. ``[(MyActivation, Pass())]``).

    Example:
        >>> EpsilonPlus().layer_map[-1]
        (<class 'torch.nn.modules.linear.Linear'>, Epsilon(epsilon=1e-06))
    """

    def __init__(self, epsilon: float = 1e-6, stabilizer: float = 1e-6, layer_map: LayerMap = ()) -> None:
        super().__init__(
            [*layer_map, (CONVOLUTIONS, ZPlus(stabilizer)), (nn.Linear, Epsilon(epsilon))], stabilizer=stabilizer
        )


class EpsilonPlusFlat(Composite):
    """``EpsilonPlus`` with ``Flat`` on the first layer (conv or linear); zennit's ``EpsilonPlusFlat``.

    Args:
        epsilon: the ``Epsilon`` rule's epsilon.
        stabilizer: the other rules' stabiliser.
        layer_map: entries looked up before the composite's own.

    Example:
        >>> EpsilonPlusFlat().first_map
        [((<class 'torch.nn.modules.linear.Linear'>, ...), Flat(stabilizer=1e-06))]
    """

    def __init__(self, epsilon: float = 1e-6, stabilizer: float = 1e-6, layer_map: LayerMap = ()) -> None:
        super().__init__(
            [*layer_map, (CONVOLUTIONS, ZPlus(stabilizer)), (nn.Linear, Epsilon(epsilon))],
            [(AFFINE, Flat(stabilizer))],
            stabilizer=stabilizer,
        )


class EpsilonAlpha2Beta1(Composite):
    """``AlphaBeta(2, 1)`` on convolutions, ``Epsilon`` on linear layers (zennit's ``EpsilonAlpha2Beta1``).

    Args:
        epsilon: the ``Epsilon`` rule's epsilon.
        stabilizer: the other rules' stabiliser.
        layer_map: entries looked up before the composite's own.

    Example:
        >>> EpsilonAlpha2Beta1().layer_map[0][1]
        AlphaBeta(alpha=2.0, beta=1.0, stabilizer=1e-06)
    """

    def __init__(self, epsilon: float = 1e-6, stabilizer: float = 1e-6, layer_map: LayerMap = ()) -> None:
        super().__init__(
            [*layer_map, (CONVOLUTIONS, AlphaBeta(2.0, 1.0, stabilizer)), (nn.Linear, Epsilon(epsilon))],
            stabilizer=stabilizer,
        )


class EpsilonGammaBox(Composite):
    """``Gamma`` on convolutions, ``Epsilon`` on linear layers, ``ZBox(low, high)`` on the first convolution.

    zennit's ``EpsilonGammaBox``: ``low`` and ``high`` bound the input (e.g. the normalised values of pixels 0 and 1,
    per channel as ``(1, C, 1, 1)`` tensors).

    Args:
        low: the lowest input value (a number or a tensor broadcast to the input).
        high: the highest input value.
        epsilon: the ``Epsilon`` rule's epsilon.
        gamma: the ``Gamma`` rule's gamma.
        stabilizer: the other rules' stabiliser.
        layer_map: entries looked up before the composite's own.

    Example:
        >>> EpsilonGammaBox(-1.0, 1.0).first_map
        [((<class 'torch.nn.modules.conv.Conv1d'>, ...), ZBox(low=-1.0, high=1.0, stabilizer=1e-06))]
    """

    def __init__(
        self,
        low: float | object,
        high: float | object,
        epsilon: float = 1e-6,
        gamma: float = 0.25,
        stabilizer: float = 1e-6,
        layer_map: LayerMap = (),
    ) -> None:
        super().__init__(
            [*layer_map, (CONVOLUTIONS, Gamma(gamma, stabilizer)), (nn.Linear, Epsilon(epsilon))],
            [(CONVOLUTIONS, ZBox(low, high, stabilizer))],  # type: ignore[arg-type]
            first_types=CONVOLUTIONS,
            stabilizer=stabilizer,
        )
