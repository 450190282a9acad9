"""Hewitt & Liang's control task: each type (a word, a token id) gets one fixed random label.

A probe that reaches the same held-out accuracy on the control labels as on the real ones has learned to memorise
types, not read a property from the representation; selectivity is the difference of the two accuracies.
"""

from __future__ import annotations

import torch


def control_labels(keys: torch.Tensor, labels: torch.Tensor, classes: int, seed: int) -> torch.Tensor:
    """One random label per distinct key, drawn from the labels' empirical distribution; ``(n,)`` like ``keys``.

    Example:
        >>> keys = torch.tensor([7, 3, 7, 7, 3])
        >>> out = control_labels(keys, torch.tensor([0, 1, 1, 0, 1]), 2, seed=0)
        >>> bool(out[0] == out[2] == out[3]) and bool(out[1] == out[4])
        True
    """
    distinct, inverse = torch.unique(keys, return_inverse=True)
    frequencies = torch.bincount(labels, minlength=classes).double()
    generator = torch.Generator().manual_seed(seed)
    per_type = torch.multinomial(frequencies / frequencies.sum(), len(distinct), replacement=True, generator=generator)
    return per_type[inverse]
