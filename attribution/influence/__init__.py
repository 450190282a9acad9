"""Data attribution: which training examples made a prediction.

Conventions held by every method: a score ``scores[i, j]`` is positive when training on example ``j`` lowers the
loss of test example ``i`` to first order (a proponent), i.e. ``g_test_i^T P g_train_j`` with ``P`` the method's
preconditioner (the identity for TracIn), without division by the training set size. Losses are per example
(``reduction="none"``, or a callable ``(outputs, batch) -> (batch,)``); a mean-reduced loss is refused.
"""

from .function import InfluenceFunction
from .gradients import per_example_gradients
from .lds import linear_datamodeling_score, retrain_on_subsets
from .projection import RandomProjection
from .tracin import TracIn

__all__ = [
    "InfluenceFunction",
    "RandomProjection",
    "TracIn",
    "linear_datamodeling_score",
    "per_example_gradients",
    "retrain_on_subsets",
]
