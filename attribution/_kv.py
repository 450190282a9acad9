"""A causal language model's key/value cache as a forward returns it: found under either keyword, checked reusable.

Whether a model takes a cache, and under which keyword, is read by :func:`attribution.models.cache_keyword`.
"""

from __future__ import annotations

from typing import Any


def returned_cache(output: Any, keyword: str) -> Any:
    """The keys/values a forward returned (under ``keyword``, or the other spelling)."""
    for name in (keyword, "past_key_values", "cache"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


def usable_cache(cache: Any, length: int) -> bool:
    """Whether a returned cache can be cropped and repeated over a batch (a full-attention ``DynamicCache``)."""
    needed = ("crop", "batch_repeat_interleave", "get_seq_length")
    if cache is None or not all(hasattr(cache, name) for name in needed):
        return False
    if getattr(cache, "is_sliding", None) and any(cache.is_sliding):  # sliding layers drop keys: not croppable
        return False
    return bool(getattr(cache, "is_croppable", True)) and int(cache.get_seq_length()) == length
