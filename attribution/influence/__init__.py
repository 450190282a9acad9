"""Data attribution: which training examples made a prediction (so far the linear datamodeling score)."""

from .lds import linear_datamodeling_score, retrain_on_subsets

__all__ = ["linear_datamodeling_score", "retrain_on_subsets"]
