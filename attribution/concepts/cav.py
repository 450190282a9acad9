"""``cav``: a concept activation vector, the direction in a layer's activations that separates a concept's examples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _fit
from ._fit import Kind
from ._record import layer_names, record_sets


@dataclass(frozen=True)
class CAV:
    """A concept activation vector (Kim et al. 2018) in one layer.

    Attributes:
        vector: ``(features,)`` unit-norm direction in the layer's flattened activations (``output.flatten(1)``),
            pointing from the counterexamples towards the concept; on the model's device.
        accuracy: the share of held-out examples that the fitted classifier puts on their own side (``nan`` when
            no example was held out).
        layer: the module name.
        kind: ``"logistic"``, ``"sgd"`` or ``"mean"``.
        shape: the layer's activation shape per example: ``vector.reshape(shape)`` lays the direction out as one
            example's activation.
    """

    vector: torch.Tensor
    accuracy: float
    layer: str
    kind: str
    shape: tuple[int, ...]


def cav(
    model: nn.Module,
    layer: Any,
    concept: Any,
    counterexamples: Any,
    kind: Kind = "logistic",
    seed: int = 0,
    *,
    held_out: float = 0.2,
    batch_size: int = 64,
) -> CAV:
    """Learn the concept activation vector of ``concept`` against ``counterexamples`` at ``layer``.

    Both example sets are run through the model once (in batches, no autograd, the model left as found) and each
    example's output of ``layer`` is flattened to one row. A seeded ``floor(held_out * n)`` examples of each set are
    held out; the classifier is fitted to the rest, on the model's device:

    * ``"logistic"``: L2-regularised logistic regression (``mean log(1 + exp(-s (z . w + b))) + 1e-3/2 |w|^2`` on
      centred rows divided by their root mean square norm), full-batch L-BFGS from 0, deterministic;
    * ``"sgd"``: a linear SVM by minibatch SGD (hinge loss, ``alpha = 0.01`` as captum's default scikit-learn
      ``SGDClassifier``), 20 epochs of minibatches of 8 in a seeded order;
    * ``"mean"``: the difference of the two sets' mean activations (FastCAV), exactly, with the rule "nearer to the
      concept's mean than to the counterexamples'" for the accuracy.

    The vector is the classifier's normal ``w / |w|``, towards the concept.

    Args:
        model: the model.
        layer: the module (a name, a glob or the module) that matches exactly one module.
        concept: the concept's examples: a tensor of inputs ``(examples, ...)``, a mapping of such tensors (HF
            keyword inputs), or an iterable of batches; at least two examples.
        counterexamples: the examples of not-the-concept (random examples, usually), in the same form and shape.
        kind: ``"logistic"``, ``"sgd"`` or ``"mean"``.
        seed: seeds the held-out split and the SGD order.
        held_out: the share of each set held out for :attr:`CAV.accuracy`, in ``[0, 1)``.
        batch_size: examples per forward for tensors and mappings.

    Returns:
        A :class:`CAV`.

    Raises:
        KeyError: ``layer`` matches no module. ValueError: it matches several; a set of fewer than two examples;
            sets whose activations differ in shape; sets whose activations do not differ.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(3, 2))
        >>> striped = torch.randn(20, 3) + torch.tensor([0.0, 4.0, 0.0])
        >>> found = cav(model, "0", striped, torch.randn(20, 3), kind="mean")
        >>> found.vector.abs().argmax().item(), found.accuracy, found.layer
        (1, 1.0, '0')
    """
    _fit.check_options(kind, held_out)
    (name,) = layer_names(model, layer, what="`layer`", one=True)
    (pos, neg), shapes = record_sets(
        model, [concept, counterexamples], ["`concept`", "`counterexamples`"], [name], batch_size=batch_size
    )
    vector, accuracy = _fit.direction(pos[name], neg[name], name, kind, seed, held_out)
    return CAV(vector, accuracy, name, kind, shapes[name])
