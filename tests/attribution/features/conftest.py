"""Models and references of the features tests: planted activations and a brute-force reading of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Planted(nn.Module):
    """A "language model" whose ``embed`` output is a known table row per token: activations planted by hand."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(table.float(), freeze=True)
        self.head = nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def brute_top(acts: torch.Tensor, included: torch.Tensor, k: int, gap: int) -> list[list[tuple[float, int, int]]]:
    """Per unit, the top ``k`` of ``(value, document, position)`` straight from the definition, slowly.

    ``acts``: ``(documents, tokens, units)``. In each document the values are taken largest first (ties: the lower
    position), each kept only if it is ``gap`` or more away from every kept one; then all documents' kept values
    are ordered by value descending, document, position.
    """
    docs, tokens, units = acts.shape
    out = []
    for u in range(units):
        kept = []
        for d in range(docs):
            entries = sorted(
                ((float(acts[d, t, u]), t) for t in range(tokens) if included[d, t] and not acts[d, t, u].isnan()),
                key=lambda e: (-e[0], e[1]),
            )
            chosen: list[int] = []
            for value, t in entries:
                if all(abs(t - c) >= max(gap, 1) for c in chosen):
                    chosen.append(t)
                    kept.append((value, d, t))
        kept.sort(key=lambda e: (-e[0], e[1], e[2]))
        out.append(kept[:k])
    return out


@pytest.fixture
def planted():
    """A planted model with integer activations (many ties, zeros, both signs) over 6 units, and 23 documents."""
    torch.manual_seed(0)
    table = torch.randint(-2, 6, (30, 6)).float()
    table[:, 5] = torch.where(table[:, 5] > 2, table[:, 5], 0.0)  # a sparse unit
    table[:, 4] = 0.0  # a dead unit
    table[0] = 0.0  # token 0 is the pad/BOS in the tests that exclude it
    ids = torch.randint(0, 30, (23, 14))
    return Planted(table), ids, table
