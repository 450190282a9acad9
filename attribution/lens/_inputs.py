"""Token ids and directions in vocabulary space, checked with errors that name the argument."""

from __future__ import annotations

from typing import Any

import torch

from .._inputs import kind_of, token_ids, vocab_size

__all__ = ["direction_matrix", "token_ids", "vocab_size"]


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
            f"an integer tensor ({batch},) or a pair of them; got {kind_of(token)}"
            + (f" of shape {tuple(ids.shape)}" if ids.dim() else "")
        )
    ids = ids.expand(batch).long()
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"`direction` holds token ids outside the vocabulary [0, {vocab}): {ids.tolist()}")
    return torch.nn.functional.one_hot(ids, vocab).double()
