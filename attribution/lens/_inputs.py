"""Token ids and directions in vocabulary space, checked with errors that name the argument."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def vocab_size(model: nn.Module) -> int:
    """The number of rows of the input embedding (``model.get_input_embeddings()``), else ``config.vocab_size``."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        raise ValueError(
            "cannot tell the vocabulary size: the model has no get_input_embeddings() nor config.vocab_size"
        )
    return int(size)


def token_ids(model: nn.Module, input_ids: Any, what: str = "input_ids") -> torch.Tensor:
    """``input_ids`` as a ``(B, T)`` integer tensor (a ``(T,)`` one gets a batch axis) whose ids are in the vocabulary.

    Raises:
        TypeError: not an integer tensor.
        ValueError: empty, more than two axes, or an id outside ``[0, vocab)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"`{what}` must be an integer tensor of token ids (B, T) or (T,); got {_kind(input_ids)}")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"`{what}` must be a non-empty (B, T) or (T,) tensor of token ids; got shape "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    vocab = vocab_size(model)
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        raise ValueError(
            f"`{what}` holds token ids outside the vocabulary [0, {vocab}): {sorted(set(ids[bad].tolist()))[:5]}; "
            "encode the text with the model's own tokenizer"
        )
    return ids.long()


def _kind(x: Any) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def direction_matrix(direction: Any, vocab: int, batch: int) -> torch.Tensor:
    """``(B, vocab)`` float64 rows: one-hot for a token, ``e_a - e_b`` for a pair, the vector itself for a vector.

    ``direction`` is an int token id, a pair ``(a, b)`` (logit of ``a`` minus logit of ``b``), a float tensor of size
    vocab, or one of each per example: an integer tensor ``(B,)``, a pair of them, or a float tensor ``(B, vocab)``.
    """
    if isinstance(direction, torch.Tensor) and direction.is_floating_point():
        if (
            direction.shape[-1:] != (vocab,)
            or direction.dim() > 2
            or (direction.dim() == 2 and len(direction) != batch)
        ):
            raise ValueError(
                f"`direction` as a vector must have size vocab={vocab} (or shape ({batch}, {vocab}), one per example); "
                f"got shape {tuple(direction.shape)}"
            )
        return direction.detach().double().cpu().expand(batch, vocab).clone()
    if isinstance(direction, (tuple, list)) and len(direction) == 2:
        return _one_hot(direction[0], vocab, batch) - _one_hot(direction[1], vocab, batch)
    return _one_hot(direction, vocab, batch)


def _one_hot(token: Any, vocab: int, batch: int) -> torch.Tensor:
    ids = torch.as_tensor(token)
    if ids.is_floating_point() or ids.dim() > 1 or (ids.dim() == 1 and len(ids) != batch):
        raise ValueError(
            "`direction` must be a token id, a pair of token ids (a, b), a float vector of size vocab, or per example "
            f"an integer tensor ({batch},) or a pair of them; got {_kind(token)}"
            + (f" of shape {tuple(ids.shape)}" if ids.dim() else "")
        )
    ids = ids.expand(batch).long()
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"`direction` holds token ids outside the vocabulary [0, {vocab}): {ids.tolist()}")
    return torch.nn.functional.one_hot(ids, vocab).double()
