"""Which random examples each TCAV run uses: the counterexamples of the concepts' CAVs and the null's two sets.

A run ``i`` is three sets of rows of the recorded random examples: ``against`` (the counterexamples of every
concept's CAV in that run), and ``null_concept`` and ``null_against`` (the random-vs-random CAV of that run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    """The rows (indices into the random examples' activations, all sets concatenated) of one run."""

    against: torch.Tensor
    null_concept: torch.Tensor
    null_against: torch.Tensor


def kim_runs(sizes: list[int], runs: int) -> list[Run]:
    """Kim et al.'s design for a list of random sets of ``sizes`` examples: run ``i`` is set ``i + 1`` against all.

    Run ``i`` uses set ``i + 1`` as the concepts' counterexamples, and its null CAV is set 0 against set ``i + 1``
    (set 0 plays the concept in every null run).

    Example:
        >>> [run.against.tolist() for run in kim_runs([2, 1, 2], 2)], kim_runs([2, 1, 2], 2)[1].null_concept.tolist()
        ([[2], [3, 4]], [0, 1])
    """
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    rows = [torch.arange(starts[k], starts[k + 1]) for k in range(len(sizes))]
    return [Run(rows[i + 1], rows[0], rows[i + 1]) for i in range(runs)]


def pool_runs(pool: int, size: int, runs: int, seed: int) -> list[Run]:
    """Each run draws three disjoint sets of ``size`` rows from a pool of ``pool`` rows, afresh (seeded).

    The null CAVs of different runs share no fixed set, so the null's spread is the spread of random-vs-random CAVs.

    Example:
        >>> run = pool_runs(9, 3, runs=2, seed=0)[0]
        >>> sorted(torch.cat([run.against, run.null_concept, run.null_against]).tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8]
    """
    if 3 * size > pool:
        raise ValueError(
            f"`random_concepts` is a pool of {pool} examples, but each run draws three disjoint sets of {size} "
            f"(the concepts' counterexamples, and the two sets of a random-vs-random CAV): give at least {3 * size} "
            "examples, or a smaller `set_size`"
        )
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for _ in range(runs):
        rows = torch.randperm(pool, generator=generator)[: 3 * size]
        drawn.append(Run(rows[:size], rows[size : 2 * size], rows[2 * size :]))
    return drawn
