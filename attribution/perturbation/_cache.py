"""Keys/values of a causal language model's unperturbed prefix, reused by every perturbation that starts later.

Until the model reader ``attribution.models`` answers whether a model takes ``past_key_values``,
:func:`accepts_past_key_values` answers it here, from ``forward``'s signature.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn


def accepts_past_key_values(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``input_ids``, ``past_key_values`` and ``use_cache`` (HuggingFace causal LMs)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in ("input_ids", "past_key_values", "use_cache"))


def usable_cache(cache: Any, length: int) -> bool:
    """Whether a returned cache can be cropped and repeated over a batch (a full-attention ``DynamicCache``)."""
    needed = ("crop", "batch_repeat_interleave", "get_seq_length")
    if cache is None or not all(hasattr(cache, name) for name in needed):
        return False
    if getattr(cache, "is_sliding", None) and any(cache.is_sliding):  # sliding layers drop keys: not croppable
        return False
    return bool(getattr(cache, "is_croppable", True)) and int(cache.get_seq_length()) == length


def prefix_cache(cache: Any, length: int, repeats: int) -> Any:
    """A copy of ``cache`` cut to its first ``length`` positions, each batch row repeated ``repeats`` times in a row."""
    copied = copy.deepcopy(cache)
    copied.crop(length)
    if repeats > 1:
        copied.batch_repeat_interleave(repeats)
    return copied


def first_changes(perturbed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per perturbation, the first position whose token differs from ``x`` in any item (``T`` where none does).

    ``perturbed`` is ``(batch, P, T)``, ``x`` is ``(batch, T)``; returns ``(P,)``.

    Example:
        >>> first_changes(torch.tensor([[[1, 2, 3], [1, 0, 0], [1, 2, 3]]]), torch.tensor([[1, 2, 3]]))
        tensor([3, 1, 3])
    """
    changed = (perturbed != x[:, None]).any(0)  # (P, T)
    length = x.shape[-1]
    position = torch.where(changed, torch.arange(length, device=x.device), length)
    return position.min(-1).values
