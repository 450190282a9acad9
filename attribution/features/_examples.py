"""Examples kept per group (a unit, or a unit's band): a fixed number of slots, merged exactly, with contexts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import torch

from . import _math

By = Literal["value", "key"]


@dataclass
class Slots:
    """``size`` examples per group, best first; an empty slot has document ``-1``.

    ``tokens``/``acts`` hold each example's context: the token ids and the unit's activations from ``left`` positions
    before it to ``right`` after it (``-1`` and NaN beyond the document).
    """

    value: torch.Tensor
    """``(groups, size)`` float32."""
    key: torch.Tensor
    """``(groups, size)`` int64: the sampling key (samples), 0 for top examples."""
    document: torch.Tensor
    position: torch.Tensor
    tokens: torch.Tensor
    """``(groups, size, left + 1 + right)`` int64."""
    acts: torch.Tensor
    """``(groups, size, left + 1 + right)`` float32."""

    @classmethod
    def empty(cls, groups: int, size: int, width: int) -> Slots:
        """No examples yet."""
        return cls(
            value=torch.full((groups, size), _math.NEG),
            key=torch.zeros((groups, size), dtype=torch.long),
            document=torch.full((groups, size), -1, dtype=torch.long),
            position=torch.zeros((groups, size), dtype=torch.long),
            tokens=torch.full((groups, size, width), -1, dtype=torch.long),
            acts=torch.full((groups, size, width), float("nan")),
        )

    @property
    def full(self) -> torch.Tensor:
        """``(groups,)`` whether every slot is taken."""
        return self.document[:, -1] >= 0

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors, by name (for saving)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Candidates:
    """New examples of one batch: their group, the unit and batch row they come from, and their order keys."""

    group: torch.Tensor
    unit: torch.Tensor
    row: torch.Tensor
    value: torch.Tensor
    key: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor


Context = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def merge(slots: Slots, new: Candidates, by: By, context: Context) -> Slots:
    """The best ``size`` of the kept and the new examples per group, exactly (ties by document, then position).

    Args:
        slots: the examples kept so far.
        new: the candidates.
        by: ``"value"`` (largest first: top examples) or ``"key"`` (smallest sampling key first: uniform samples).
        context: ``indices -> (tokens, acts)``, the contexts of the candidates at those indices (asked only for the
            candidates that are kept).
    """
    groups, size = slots.value.shape
    old = slots.document >= 0
    old_group = torch.arange(groups)[:, None].expand(groups, size)[old]
    group = torch.cat([old_group, new.group])
    value = torch.cat([slots.value[old], new.value])
    key = torch.cat([slots.key[old], new.key])
    document = torch.cat([slots.document[old], new.document])
    position = torch.cat([slots.position[old], new.position])
    primary = -value if by == "value" else key
    perm = _math.lexsort(position, document, primary, group)
    rank = _math.group_rank(group[perm])
    perm, rank = perm[rank < size], rank[rank < size]
    out = Slots.empty(groups, size, slots.tokens.shape[-1])
    g = group[perm]
    for name, source in (("value", value), ("key", key), ("document", document), ("position", position)):
        getattr(out, name)[g, rank] = source[perm]
    n_old = len(old_group)
    kept_old = perm < n_old
    out.tokens[g[kept_old], rank[kept_old]] = slots.tokens[old][perm[kept_old]]
    out.acts[g[kept_old], rank[kept_old]] = slots.acts[old][perm[kept_old]]
    fresh = perm[~kept_old] - n_old
    tokens, acts = context(fresh)
    out.tokens[g[~kept_old], rank[~kept_old]] = tokens
    out.acts[g[~kept_old], rank[~kept_old]] = acts
    return out


def merge_slots(a: Slots, b: Slots, by: By) -> Slots:
    """Two slot sets of the same groups as one (their contexts carried along)."""
    taken = b.document >= 0
    group = torch.arange(b.value.shape[0])[:, None].expand_as(b.value)[taken]
    candidates = Candidates(
        group=group,
        unit=group,
        row=group,
        value=b.value[taken],
        key=b.key[taken],
        document=b.document[taken],
        position=b.position[taken],
    )
    tokens, acts = b.tokens[taken], b.acts[taken]
    return merge(a, candidates, by, lambda i: (tokens[i], acts[i]))


def contexts(
    batch: tuple[torch.Tensor, torch.Tensor],
    unit: torch.Tensor,
    row: torch.Tensor,
    position: torch.Tensor,
    left: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(examples, width)`` token ids and activations around each example (``-1`` and NaN beyond the document).

    Example:
        >>> acts, ids = torch.arange(6.0).reshape(1, 1, 6), torch.arange(10, 16).reshape(1, 6)
        >>> t, a = contexts((acts, ids), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), 2, 4)
        >>> t.tolist(), a.tolist()
        ([[-1, 10, 11, 12]], [[nan, 0.0, 1.0, 2.0]])
    """
    acts, ids = batch
    tokens = ids.shape[1]
    where = position[:, None] + torch.arange(-left, width - left)[None, :]
    inside = (where >= 0) & (where < tokens)
    clamped = where.clamp(0, tokens - 1)
    token_ids = torch.where(inside, ids[row[:, None], clamped], -1)
    values = torch.where(inside, acts[unit[:, None], row[:, None], clamped].float(), float("nan"))
    return token_ids, values
