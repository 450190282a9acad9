"""Pure tensor math of the streamed statistics: peaks, ordered merges, moments, the quantile sketch, hashed samples.

Everything here is a function of tensors, so it is tested without a model. The conventions:

* a unit's activations in one batch are ``acts: (units, documents, tokens)``; excluded positions hold ``-inf``;
* an example is ``(value, document, position)``, ordered by value descending, then document, then position;
* the moments of a unit are ``(count, mean, M2, M3, M4)`` with ``Mp = sum (x - mean)^p`` (Pébay 2008), merged exactly
  as written in :func:`merge_moments`, always left block first, so that a fixed tree of merges gives fixed bits.
"""

from __future__ import annotations

import math

import torch

NEG = float("-inf")

# -- exact top-k with a minimum gap --------------------------------------------------------------------------------


def peaks(acts: torch.Tensor, k: int, gap: int, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` peaks per unit and document, greedily: the largest value, then the largest ``gap`` or more away.

    Args:
        acts: ``(units, documents, tokens)``; excluded positions ``-inf``.
        k: peaks per unit and document.
        gap: two peaks of one document are at least ``gap`` positions apart (``gap <= 1``: distinct positions).
        floor: ``(units,)``; only values above it can enter the unit's top-k (``-inf``: any finite value). A unit's
            full top-k admits no value equal to its last one either, since documents come in order and a tie goes to
            the earlier document.

    Returns:
        ``values, positions``: ``(units, documents, k)``, best first; ``-inf`` (position 0) where there is none.

    Example:
        >>> values, positions = peaks(torch.tensor([[[1.0, 5.0, 4.0, 0.0, 3.0]]]), 3, 2, torch.tensor([NEG]))
        >>> values.tolist(), positions.tolist()
        ([[[5.0, 3.0, -inf]]], [[[1, 4, 0]]])
    """
    units, docs, tokens = acts.shape
    values = torch.full((units * docs, k), NEG, dtype=acts.dtype)
    positions = torch.zeros((units * docs, k), dtype=torch.long)
    work = acts.reshape(units * docs, tokens)
    rows = torch.arange(units * docs)
    row_floor = floor.to(acts.dtype).repeat_interleave(docs)
    offsets = torch.arange(-(max(gap, 1) - 1), max(gap, 1))
    for r in range(k):
        value, position = work.max(dim=1)
        live = value > row_floor
        if not bool(live.any()):
            break
        if not bool(live.all()):
            work, rows, row_floor, value, position = (t[live] for t in (work, rows, row_floor, value, position))
        values[rows, r], positions[rows, r] = value, position
        work = work.clone() if r == 0 else work  # never write into the caller's tensor
        work.scatter_(1, (position[:, None] + offsets).clamp(0, tokens - 1), NEG)
    return values.reshape(units, docs, k), positions.reshape(units, docs, k)


def lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """The permutation of 1-D ``keys`` that sorts by the last key, then the one before it, ... (as ``numpy.lexsort``).

    Example:
        >>> value, document = torch.tensor([1.0, 2.0, 2.0, 2.0]), torch.tensor([0, 5, 3, 3])
        >>> lexsort(torch.tensor([0, 0, 9, 2]), document, -value).tolist()
        [3, 2, 1, 0]
    """
    perm = torch.argsort(keys[0], stable=True)
    for key in keys[1:]:
        perm = perm[torch.argsort(key[perm], stable=True)]
    return perm


def group_rank(group: torch.Tensor) -> torch.Tensor:
    """Each entry's rank within its group, for entries already sorted by group.

    Example:
        >>> group_rank(torch.tensor([0, 0, 2, 2, 2, 5])).tolist()
        [0, 1, 0, 1, 2, 0]
    """
    if not len(group):
        return group
    start = torch.ones_like(group, dtype=torch.bool)
    start[1:] = group[1:] != group[:-1]
    first = torch.arange(len(group))[start]
    return torch.arange(len(group)) - first.repeat_interleave(torch.diff(first, append=torch.tensor([len(group)])))


# -- hashed uniform samples -----------------------------------------------------------------------------------------

_P = 2_147_483_647  # 2^31 - 1: every product below stays under 2^62


def place_keys(seed: int, documents: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(len(documents), len(positions))`` pseudo-random keys in ``[0, 2^31 - 1)`` of the places (one per token)."""
    start = torch.tensor((seed * 2_654_435 + 97) % _P)
    return _mix(_mix(start, documents[:, None], 69_621), positions[None, :], 16_807)


def unit_offsets(seed: int, units: torch.Tensor) -> torch.Tensor:
    """``(len(units),)`` each unit's pseudo-random offset in ``[0, 2^31 - 1)``, added to the places' keys."""
    return _mix(torch.tensor((seed * 2_654_435 + 97) % _P), units, 48_271)


def keys(seed: int, units: torch.Tensor, documents: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(len(units), len(documents), len(positions))`` pseudo-random keys in ``[0, 2^31 - 1)``, the same anywhere.

    Keeping the smallest keys of a set is a uniform sample of it without replacement that any split of the data
    merges to exactly (bottom-k sampling), so band samples and non-activating examples depend neither on the
    batches, nor on shards or resumes. A unit's key of a place is the place's key plus the unit's offset, modulo
    ``2^31 - 1``: for each unit the keys are as random as the places' keys, and the smallest keys of a batch are found
    for every unit from one sort of its places (:func:`smallest_keys`); units with different offsets draw different
    places.

    Example:
        >>> a = keys(0, torch.tensor([1]), torch.tensor([2]), torch.tensor([3, 4]))
        >>> a.shape, bool(a[0, 0, 0] != a[0, 0, 1]), bool(torch.equal(a, keys(0, torch.tensor([1]),
        ...     torch.tensor([2]), torch.tensor([3, 4]))))
        (torch.Size([1, 1, 2]), True, True)
    """
    return (place_keys(seed, documents, positions)[None] + unit_offsets(seed, units)[:, None, None]) % _P


def keys_at(seed: int, unit: torch.Tensor, document: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The keys of :func:`keys` for entries given one by one (tensors of one shape).

    Example:
        >>> grid = keys(3, torch.tensor([0, 4]), torch.tensor([7]), torch.arange(5))
        >>> int(keys_at(3, torch.tensor([4]), torch.tensor([7]), torch.tensor([2]))[0]) == int(grid[1, 0, 2])
        True
    """
    start = torch.tensor((seed * 2_654_435 + 97) % _P)
    place = _mix(_mix(start, document, 69_621), position, 16_807)
    return (place + unit_offsets(seed, unit)) % _P


def smallest_keys(
    place: torch.Tensor, offsets: torch.Tensor, eligible: torch.Tensor, ceiling: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per unit, the eligible places with the ``size`` smallest keys (all ties with the last kept) up to ``ceiling``.

    A unit's keys are ``(place + offset) % P``: in the order of the sorted place keys, started at the first place
    with ``place >= P - offset`` and wrapped around, they ascend. So each unit reads a window of the sorted places
    from its own start; a unit whose window holds too few eligible places reads all of them.

    Args:
        place: ``(places,)`` the places' keys.
        offsets: ``(units,)`` the units' offsets.
        eligible: ``(units, places)`` bool.
        ceiling: ``(units,)`` only keys up to it are wanted.
        size: places wanted per unit.

    Returns:
        ``(unit, place, key)`` of the chosen entries.

    Example:
        >>> place, offsets = torch.tensor([5, 1, 9, 3]), torch.tensor([0, _P - 4])
        >>> unit, index, key = smallest_keys(place, offsets, torch.ones(2, 4, dtype=torch.bool),
        ...                                  torch.tensor([2**62, 2**62]), 2)
        >>> unit.tolist(), index.tolist(), key.tolist()
        ([0, 0, 1, 1], [1, 3, 0, 2], [1, 3, 1, 5])
    """
    n = len(place)
    ordered, order = place.sort(stable=True)
    start = torch.searchsorted(ordered, _P - offsets)
    chosen = _window(ordered, order, offsets, eligible, ceiling, start, torch.arange(len(offsets)), size, 4 * size + 28)
    unit, index, key, short = chosen
    if len(short):  # too few in the window (or ties past its end): those units read every place
        again = _window(ordered, order, offsets, eligible, ceiling, start, short, size, n)
        keep = ~torch.isin(unit, short)
        unit, index, key = (torch.cat([a[keep], b]) for a, b in zip((unit, index, key), again[:3], strict=True))
        by_unit = torch.argsort(unit, stable=True)
        unit, index, key = unit[by_unit], index[by_unit], key[by_unit]
    return unit, index, key


def _window(
    ordered: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    eligible: torch.Tensor,
    ceiling: torch.Tensor,
    start: torch.Tensor,
    units: torch.Tensor,
    size: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`smallest_keys` over ``width`` places from each unit's start; also the units it could not decide."""
    n = len(ordered)
    width = min(width, n)
    steps = (start[units, None] + torch.arange(width)) % n
    index = order[steps]
    key = (ordered[steps] + offsets[units, None]) % _P
    ok = eligible[units].gather(1, index) & (key <= ceiling[units, None])
    rank = ok.cumsum(1)
    enough = rank[:, -1] >= size
    kth = key.gather(1, (rank >= size).to(torch.uint8).argmax(1, keepdim=True))
    take = ok & (~enough[:, None] | (key <= kth))
    last = key[:, -1]  # the window's largest key: past it, places may still be eligible, or tie with the kth
    more = torch.where(enough, last <= kth.squeeze(1), last <= ceiling[units])
    undecided = more if width < n else torch.zeros_like(enough)
    row, column = take.nonzero(as_tuple=True)
    return units[row], index[row, column], key[row, column], units[undecided]


def _mix(h: torch.Tensor, part: torch.Tensor, multiplier: int) -> torch.Tensor:
    """One round of the keys' hash (every product stays below 2^62)."""
    h = ((h ^ (part % _P)) * multiplier + 12_345) % _P
    return ((h ^ (h >> 13)) * 40_692) % _P


# -- moments --------------------------------------------------------------------------------------------------------


def moments(x: torch.Tensor, included: torch.Tensor) -> torch.Tensor:
    """``(5, units)`` float64: count, mean and the centred power sums M2, M3, M4 of the included values.

    Args:
        x: ``(units, values)``.
        included: ``(units, values)`` bool.

    Example:
        >>> m = moments(torch.tensor([[1.0, 2.0, 6.0]]), torch.tensor([[True, True, True]]))
        >>> m[:, 0].tolist()
        [3.0, 3.0, 14.0, 18.0, 98.0]
    """
    x = torch.where(included, x.double(), 0.0)
    count = included.sum(1).double()
    mean = x.sum(1) / count.clamp(min=1)
    d = torch.where(included, x - mean[:, None], 0.0)
    d2 = d * d
    return torch.stack([count, mean, d2.sum(1), (d2 * d).sum(1), (d2 * d2).sum(1)])


def entry_moments(unit: torch.Tensor, value: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """:func:`moments` from the non-zero values alone: ``count - (their number)`` zeros make up the rest.

    Args:
        unit: ``(entries,)`` each value's unit.
        value: ``(entries,)`` the non-zero values.
        count: ``(units,)`` how many values each unit has in all (zeros included).

    Example:
        >>> m = entry_moments(torch.tensor([0, 0, 0]), torch.tensor([1.0, 2.0, 6.0]), torch.tensor([4]))
        >>> bool(torch.allclose(m, moments(torch.tensor([[1.0, 2.0, 0.0, 6.0]]), torch.ones(1, 4, dtype=torch.bool))))
        True
    """
    n = count.double()
    x = value.double()
    zeros = n - torch.bincount(unit, minlength=len(count)).double()
    mean = torch.zeros_like(n).index_add_(0, unit, x) / n.clamp(min=1)
    d = x - mean[unit]
    d2 = d * d

    def total(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(n).index_add_(0, unit, v)

    m2 = total(d2) + zeros * mean**2
    m3 = total(d2 * d) - zeros * mean**3
    m4 = total(d2 * d2) + zeros * mean**4
    return torch.stack([n, mean, m2, m3, m4])


def merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The moments of two disjoint sets from theirs (Pébay 2008, eq. 2.1-2.3); ``a`` is the earlier block.

    Example:
        >>> x, on = torch.tensor([[1.0, 2.0, 6.0, -1.0]]), torch.ones(1, 4, dtype=torch.bool)
        >>> merged = merge_moments(moments(x[:, :1], on[:, :1]), moments(x[:, 1:], on[:, 1:]))
        >>> bool(torch.allclose(merged, moments(x, on)))
        True
    """
    na, ma, a2, a3, a4 = a
    nb, mb, b2, b3, b4 = b
    n = na + nb
    safe = n.clamp(min=1)
    delta = mb - ma
    mean = ma + delta * nb / safe
    m2 = a2 + b2 + delta**2 * na * nb / safe
    m3 = a3 + b3 + delta**3 * na * nb * (na - nb) / safe**2 + 3 * delta * (na * b2 - nb * a2) / safe
    m4 = (
        a4
        + b4
        + delta**4 * na * nb * (na * na - na * nb + nb * nb) / safe**3
        + 6 * delta**2 * (na * na * b2 + nb * nb * a2) / safe**2
        + 4 * delta * (na * b3 - nb * a3) / safe
    )
    return torch.stack([n, mean, m2, m3, m4])


def describe_moments(m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean, population variance, skewness and excess kurtosis (0 for a normal, as ``scipy.stats.kurtosis``).

    Undefined values (no values; zero variance for skewness and kurtosis) are NaN.

    Example:
        >>> d = describe_moments(torch.tensor([[3.0], [3.0], [14.0], [18.0], [98.0]], dtype=torch.float64))
        >>> round(float(d["variance"]), 4), round(float(d["skewness"]), 4), round(float(d["kurtosis"]), 4)
        (4.6667, 0.5952, -1.5)
    """
    n, mean, m2, m3, m4 = m
    nan = torch.full_like(n, math.nan)
    some = n > 0
    varied = some & (m2 > 0)
    variance = torch.where(some, m2 / n.clamp(min=1), nan)
    skewness = torch.where(varied, (m3 / n.clamp(min=1)) / variance.clamp(min=1e-300) ** 1.5, nan)
    kurtosis = torch.where(varied, (m4 / n.clamp(min=1)) / variance.clamp(min=1e-300) ** 2 - 3, nan)
    return {"mean": torch.where(some, mean, nan), "variance": variance, "skewness": skewness, "kurtosis": kurtosis}


def fold_blocks(blocks: list[tuple[int, int, torch.Tensor]]) -> list[tuple[int, int, torch.Tensor]]:
    """Merge adjacent sibling blocks ``(start, size, moments)`` into their parent until none are left.

    Blocks are aligned dyadic ranges of batch numbers (``start`` a multiple of ``size``, a power of two). The tree
    of merges is fixed by the batch numbers alone, so one process, a resumed one and any split into shards produce
    the same blocks, bit for bit.

    Example:
        >>> one = torch.ones(5, 1, dtype=torch.float64)
        >>> [(s, n) for s, n, _ in fold_blocks([(0, 1, one), (1, 1, one), (2, 1, one)])]
        [(0, 2), (2, 1)]
    """
    out: list[tuple[int, int, torch.Tensor]] = []
    for block in sorted(blocks, key=lambda b: b[0]):
        out.append(block)
        while len(out) >= 2:
            (s1, n1, m1), (s2, n2, m2) = out[-2], out[-1]
            if n1 != n2 or s1 % (2 * n1) or s1 + n1 != s2:
                break
            out[-2:] = [(s1, 2 * n1, merge_moments(m1, m2))]
    return out


def total_moments(blocks: list[tuple[int, int, torch.Tensor]], units: int) -> torch.Tensor:
    """The moments of all blocks: siblings folded, then the rest merged left to right."""
    total = torch.zeros(5, units, dtype=torch.float64)
    for _, _, m in fold_blocks(blocks):
        total = merge_moments(total, m)
    return total


# -- the quantile sketch --------------------------------------------------------------------------------------------

ALPHA = 0.02
"""The sketch's relative value accuracy: every value is counted in a bucket ``(g^(i-1), g^i]``, ``g = (1+a)/(1-a)``."""
GAMMA = (1 + ALPHA) / (1 - ALPHA)
LOW, HIGH = 1e-6, 1e6
"""Magnitudes below ``LOW`` (but not zero) share one bucket per sign, as do those above ``HIGH``."""
_I0 = math.ceil(math.log(LOW) / math.log(GAMMA))
_I1 = math.ceil(math.log(HIGH) / math.log(GAMMA))
SIDE = _I1 - _I0 + 2  # buckets per sign: the tiny one, the regular ones, the huge one
BUCKETS = 2 * SIDE + 1  # negative side (largest magnitude first), zero, positive side


def bucket(x: torch.Tensor) -> torch.Tensor:
    """The sketch bucket of each value: ``SIDE`` is zero; above it the positive side, below it the negative one.

    Example:
        >>> b = bucket(torch.tensor([0.0, 1.0, -1.0, 1e-9, 1e9]))
        >>> int(b[0]) == SIDE, int(b[1]) + int(b[2]) == 2 * SIDE, int(b[3]) == SIDE + 1, int(b[4]) == BUCKETS - 1
        (True, True, True, True)
    """
    magnitude = x.abs().double()
    index = torch.ceil(torch.log(magnitude.clamp(min=LOW, max=HIGH)) / math.log(GAMMA)).long() - _I0 + 1
    index = torch.where(magnitude < LOW, 0, torch.where(magnitude > HIGH, SIDE - 1, index.clamp(1, SIDE - 2)))
    side = SIDE + 1 + index
    return torch.where(x > 0, side, torch.where(x < 0, SIDE - 1 - index, SIDE))


def bucket_values() -> torch.Tensor:
    """``(BUCKETS,)`` float64: the value each bucket stands for (within ``ALPHA`` of any value in it, but the ends)."""
    i = torch.arange(SIDE - 2, dtype=torch.float64) + _I0
    regular = 2 * GAMMA**i / (GAMMA + 1)
    side = torch.cat([torch.tensor([LOW / 2]), regular, torch.tensor([HIGH])])
    return torch.cat([-side.flip(0), torch.zeros(1, dtype=torch.float64), side])


def sketch_quantile(counts: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``(units, len(q))``: the value standing for the bucket that holds rank ``ceil(q * n)`` (at least 1).

    Args:
        counts: ``(units, BUCKETS)`` counts.
        q: quantiles in ``[0, 1]``.
    """
    total = counts.sum(1, keepdim=True)
    cumulative = counts.cumsum(1)
    rank = torch.ceil(q.double()[None, :] * total).clamp(min=1).long()
    index = torch.searchsorted(cumulative, rank).clamp(max=BUCKETS - 1)
    values = bucket_values()[index]
    return torch.where(total > 0, values, math.nan)


def sketch_counts(unit: torch.Tensor, value: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``(units, BUCKETS)`` the sketch of the non-zero ``value`` of each ``unit`` and of ``zeros`` zeros per unit."""
    units = len(zeros)
    counts = torch.bincount(unit * BUCKETS + bucket(value), minlength=units * BUCKETS).reshape(units, BUCKETS)
    counts[:, SIDE] += zeros
    return counts


def rank_error(counts: torch.Tensor) -> torch.Tensor:
    """``(units,)``: the bound on the rank error (a fraction of the values) of any quantile the sketch answers.

    A quantile's true value lies in the bucket the sketch names, so its rank is off by less than the count of that
    bucket; zero is its own exact bucket and does not count.
    """
    total = counts.sum(1).clamp(min=1)
    inexact = counts.clone()
    inexact[:, SIDE] = 0
    return inexact.max(1).values.double() / total


# -- co-activation --------------------------------------------------------------------------------------------------

QUANTUM = 12
"""Activations enter the co-activation sums rounded to steps of ``2^-QUANTUM``, clamped to ``+-2^(20 - QUANTUM)``."""
_LIMIT = 2.0**20
MAX_PAIRS = 2**25
"""Above this many pairs of non-zero entries in one batch, co-activation sums are taken densely."""


def coactivation(acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gram, sums)``: the products' and the values' sums of ``(units, values)`` activations, as exact integers.

    The activations are rounded to multiples of ``2^-QUANTUM``; the products of those integers, summed over one batch
    in float64, stay below ``2^53`` (up to ``2^13`` values per call), so each batch's sums are exact and adding them
    as int64 is exact too: any split of the data gives the same sums. Sparse activations (dictionary features) take
    a sparse product.

    Example:
        >>> gram, sums = coactivation(torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.0, 0.0]]))
        >>> (gram.double() / 4**QUANTUM).tolist(), (sums.double() / 2**QUANTUM).tolist()
        ([[5.0, 0.5], [0.5, 0.25]], [3.0, 0.5])
    """
    q = torch.round(acts.double() * 2**QUANTUM).clamp(-_LIMIT, _LIMIT)
    gram = torch.zeros(q.shape[0], q.shape[0], dtype=torch.long)
    for chunk in q.split(2**13, dim=1):
        if chunk.count_nonzero() * 8 < chunk.numel():
            sparse = chunk.to_sparse()
            product = torch.sparse.mm(sparse, chunk.T.contiguous())
        else:
            product = chunk @ chunk.T
        gram += product.long()
    return gram, q.sum(1).long()


def entry_coactivation(
    row: torch.Tensor, column: torch.Tensor, value: torch.Tensor, units: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`coactivation` of the non-zero entries ``(row, column, value)`` of a ``(units, columns)`` matrix.

    Every pair of entries of one column gives its product (integers of ``2^-QUANTUM`` steps, exact in int64).

    Returns:
        ``(index, product, sums)``: the products to add at ``index`` of the flattened ``(units, units)`` gram matrix,
        and the sums; ``None`` where the pairs would be more than :data:`MAX_PAIRS` (a dense matrix, see
        :func:`coactivation`).

    Example:
        >>> index, product, sums = entry_coactivation(torch.tensor([0, 0, 1]), torch.tensor([0, 2, 0]),
        ...                                           torch.tensor([1.0, 2.0, 0.5]), 2)
        >>> gram = torch.zeros(4, dtype=torch.long).index_add_(0, index, product).reshape(2, 2)
        >>> (gram.double() / 4**QUANTUM).tolist(), (sums.double() / 2**QUANTUM).tolist()
        ([[5.0, 0.5], [0.5, 0.25]], [3.0, 0.5])
    """
    q = torch.round(value.double() * 2**QUANTUM).clamp(-_LIMIT, _LIMIT).long()
    by_column = torch.argsort(column, stable=True)
    row, column, q = row[by_column], column[by_column], q[by_column]
    size = torch.bincount(column)[column]  # the entries of each entry's column
    if int(size.sum()) > MAX_PAIRS:
        return None
    first = torch.arange(len(column)) - group_rank(column)  # where each entry's column starts
    left = torch.repeat_interleave(torch.arange(len(column)), size)
    right = first[left] + torch.arange(len(left)) - torch.repeat_interleave(torch.cumsum(size, 0) - size, size)
    sums = torch.zeros(units, dtype=torch.long).index_add_(0, row, q)
    return row[left] * units + row[right], q[left] * q[right], sums


def correlation(gram: torch.Tensor, sums: torch.Tensor, count: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``(len(rows), units)`` Pearson correlations of the ``rows`` units with every unit (NaN where one is constant).

    Example:
        >>> gram, sums = coactivation(torch.tensor([[1.0, 0.0, 2.0], [2.0, 0.0, 4.0], [0.0, 1.0, 0.0]]))
        >>> correlation(gram, sums, 3, torch.tensor([0])).round(decimals=4).tolist()
        [[1.0, 1.0, -0.866]]
    """
    rows = torch.arange(gram.shape[0]) if rows is None else rows
    s = sums.double()
    covariance = count * gram[rows].double() - s[rows, None] * s[None, :]
    spread = (count * gram.diagonal().double() - s * s).clamp(min=0).sqrt()
    denominator = spread[rows, None] * spread[None, :]
    return torch.where(denominator > 0, covariance / denominator.clamp(min=1e-300), float("nan"))
