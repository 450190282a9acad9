"""Pure tensor math of attribution graphs: logit choice, kept row entries, influence, pruning, linear predictions.

Influence and pruning are circuit-tracer's (``circuit_tracer/graph.py``: ``normalize_matrix``, ``compute_influence``,
``compute_edge_influence``, ``find_threshold``, ``prune_graph``) computed on sparse matrices: no function here
makes an ``(n, n)`` dense tensor or sorts more than the non-zero entries.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

MAX_ITER = 1000
"""Most terms of a power series (a graph of ``L`` layers needs at most ``L + 2``; circuit-tracer's bound)."""


def sparse(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A coalesced sparse COO tensor (the indices are ours and in range: no invariant check)."""
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False).coalesce()


def salient_logits(logits: torch.Tensor, max_n: int = 10, desired: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens until their probability sums to ``desired``, at most ``max_n`` (circuit-tracer's rule).

    Args:
        logits: ``(vocab,)`` logits of one position.
        max_n: the most tokens.
        desired: the cumulative probability to reach.

    Returns:
        ``(ids, probabilities)``, most likely first.

    Example:
        >>> salient_logits(torch.log(torch.tensor([0.05, 0.6, 0.3, 0.05])))[0]
        tensor([1, 2, 0])
    """
    probs = torch.softmax(logits.double(), -1)
    top_p, top_i = torch.topk(probs, min(max_n, probs.numel()))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(desired, dtype=top_p.dtype))) + 1
    return top_i[:cutoff], top_p[:cutoff]


def kept_entries(
    blocks: Iterable[tuple[int, torch.Tensor]], keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``keep`` largest entries by magnitude, and each row's full ``sum |entry|``, block by block.

    The rows come as blocks of columns, so that no row is ever whole in memory. Once a row holds ``keep`` entries,
    a block gives only its entries larger than the row's smallest kept one (usually few), and the largest ``keep``
    of both stay. A row with fewer non-zero entries than ``keep`` keeps zeros too (drop them).

    Args:
        blocks: ``(first column, (rows, columns) values)``, every block with the same rows; columns left out are zero.
        keep: entries kept per row.

    Returns:
        ``(columns (rows, k), values (rows, k), abs_sums (rows,) float64)``, largest first, with ``k = min(keep,
        columns given)``.

    Example:
        >>> columns, values, sums = kept_entries([(0, torch.tensor([[0.5, -2.0]])), (5, torch.tensor([[1.0]]))], 2)
        >>> columns.tolist(), values.tolist(), sums.tolist()
        ([[1, 5]], [[-2.0, 1.0]], [3.5])
    """
    columns, values, sums = None, None, None
    for start, block in blocks:
        magnitude = block.abs()
        total = magnitude.sum(1).double()
        sums = total if sums is None else sums + total
        if values is None or values.shape[1] < keep:
            top = torch.topk(magnitude, min(keep, block.shape[1]), dim=1, sorted=False).indices
            columns, values = _merged(columns, values, top + start, block.gather(1, top), keep)
            continue
        row, column = (magnitude > values.abs().amin(1, keepdim=True)).nonzero(as_tuple=True)  # can enter: few
        if len(row):
            new_columns, new_values = _padded(row, column + start, block[row, column], len(block))
            columns, values = _merged(columns, values, new_columns, new_values, keep)
    if sums is None or columns is None or values is None:
        raise ValueError("kept_entries needs at least one block")
    order = torch.sort(values.abs(), dim=1, descending=True, stable=True).indices
    return columns.gather(1, order), values.gather(1, order), sums


def _padded(
    row: torch.Tensor, column: torch.Tensor, value: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries given as ``(row, column, value)`` (rows ascending) as ``(rows, width)`` tables, padded with zeros.

    Example:
        >>> _padded(torch.tensor([0, 0, 2]), torch.tensor([4, 7, 5]), torch.tensor([1.0, 2.0, 3.0]), 3)[1]
        tensor([[1., 2.],
                [0., 0.],
                [3., 0.]])
    """
    counts = torch.bincount(row, minlength=rows)
    slot = torch.arange(len(row), device=row.device) - (torch.cumsum(counts, 0) - counts)[row]
    width = int(counts.max())
    columns = column.new_zeros(rows, width)
    values = value.new_zeros(rows, width)
    columns[row, slot] = column
    values[row, slot] = value
    return columns, values


def _merged(
    columns: torch.Tensor | None, values: torch.Tensor | None, new_columns: torch.Tensor, new_values: torch.Tensor,
    keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``keep`` largest by magnitude of the kept entries and new ones, per row."""
    if columns is None or values is None:
        return new_columns, new_values
    columns, values = torch.cat([columns, new_columns], 1), torch.cat([values, new_values], 1)
    if values.shape[1] <= keep:
        return columns, values
    top = torch.topk(values.abs(), keep, dim=1, sorted=False).indices
    return columns.gather(1, top), values.gather(1, top)


def partial_influence(
    groups: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    row_node: torch.Tensor,
    start: torch.Tensor,
    n_columns: int,
) -> torch.Tensor:
    """circuit-tracer's ``compute_partial_influences`` on the kept entries of the rows computed so far.

    The power series over all paths, summed in one pass over the entries: rows go from the top layer down, and a
    row's weight (its logit weight, or the influence its node has from the rows above it) is final when its layer
    comes, since a row only reads sources of lower layers.

    Args:
        groups: the kept entries, a group of rows at a time, the groups ordered by their rows' layer from the top
            (logits) down: ``(rows (r,), sources (r, k), weights (r, k))``, each weight ``|entry| / sum |row|`` (the
            row normalised by all its entries, kept or not). Rows of one group share their layer.
        row_node: ``(rows,)`` the column each row's node has as a source (``-1``: a logit, which is none).
        start: ``(rows,)`` the logit weights on logit rows, zero elsewhere.
        n_columns: the number of source columns.

    Returns:
        ``(n_columns,)`` float64: each source's influence on the logits through the rows so far.

    Example:
        >>> # logit row 0 (weight 1) reads column 0 (a neuron, also row 1) half and column 1 half; row 1 reads column 1
        >>> groups = [(torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])),
        ...           (torch.tensor([1]), torch.tensor([[1]]), torch.tensor([[1.0]]))]
        >>> partial_influence(groups, torch.tensor([-1, 0]), torch.tensor([1.0, 0.0]), 2)
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """
    influence = torch.zeros(n_columns, dtype=torch.float64, device=start.device)
    is_node = row_node >= 0
    start = start.to(torch.float64)
    for rows, sources, weights in groups:
        per_row = start[rows] + torch.where(is_node[rows], influence[row_node[rows].clamp_min(0)], 0.0)
        influence.index_add_(0, sources.flatten(), (weights.to(torch.float64) * per_row[:, None]).flatten())
    return influence


def normalised(adjacency: torch.Tensor) -> torch.Tensor:
    """``|A|`` with each row divided by its sum (clamped at 1e-10): circuit-tracer's ``normalize_matrix``, sparse.

    Example:
        >>> a = torch.tensor([[0.0, 0.0], [3.0, -1.0]]).to_sparse()
        >>> normalised(a).to_dense()
        tensor([[0.0000, 0.0000],
                [0.7500, 0.2500]])
    """
    a = adjacency.coalesce()
    rows, values = a.indices()[0], a.values().abs()
    sums = torch.zeros(a.shape[0], dtype=values.dtype, device=values.device).index_add_(0, rows, values)
    return sparse(a.indices(), values / sums.clamp_min(1e-10)[rows], a.shape).coalesce()


def influence(matrix: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w A + w A^2 + ...`` for a sparse nilpotent ``A`` (circuit-tracer's ``compute_influence``).

    Example:
        >>> a = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]).to_sparse()
        >>> influence(a, torch.tensor([0.0, 0.0, 1.0]))      # node 0: 0.5 directly, 0.5 through node 1
        tensor([1.0000, 0.5000, 0.0000])
    """
    transposed = matrix.t().coalesce()
    current = torch.mv(transposed, weights.to(matrix.dtype))
    total = current.clone()
    for _ in range(MAX_ITER):
        if not bool(current.any()):
            return total
        current = torch.mv(transposed, current)
        total += current
    raise RuntimeError(f"the influence did not converge in {MAX_ITER} steps: the graph has a cycle")


def node_influence(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """circuit-tracer's ``compute_node_influence``: the influence on the row-normalised ``|adjacency|``."""
    return influence(normalised(adjacency), weights)


def edge_scores(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """circuit-tracer's ``compute_edge_influence``: each entry's normalised weight times its target's influence.

    Example:
        >>> a = torch.tensor([[0.0, 0.0], [2.0, 0.0]]).to_sparse()
        >>> edge_scores(a, torch.tensor([0.0, 1.0])).to_dense()
        tensor([[0., 0.],
                [1., 0.]])
    """
    matrix = normalised(adjacency)
    through = influence(matrix, weights) + weights.to(matrix.dtype)
    values = matrix.values() * through[matrix.indices()[0]]
    return sparse(matrix.indices(), values, matrix.shape).coalesce()


def find_threshold(scores: torch.Tensor, threshold: float, size: int | None = None) -> torch.Tensor:
    """circuit-tracer's ``find_threshold`` on ``scores`` padded with zeros to ``size``, sorting only the non-zeros.

    The smallest score among the largest ones that carry ``threshold`` of the total (``0`` when that needs the
    zeros). ``scores`` are non-negative; ``size`` is the length of the dense vector they stand for.

    Example:
        >>> find_threshold(torch.tensor([0.1, 0.6, 0.3]), 0.8, size=10)
        tensor(0.3000)
    """
    size = scores.numel() if size is None else size
    non_zero = scores[scores != 0]
    if non_zero.numel() == 0:
        return scores.new_zeros(())
    ordered = torch.sort(non_zero, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / ordered.sum()
    index = int(torch.searchsorted(cumulative, torch.tensor(threshold, dtype=cumulative.dtype)))
    if index < ordered.numel():
        return ordered[index]
    return ordered.new_zeros(()) if size > ordered.numel() else ordered[-1]


def prune_masks(
    adjacency: torch.Tensor, weights: torch.Tensor, n_features: int, n_tail: int, node_threshold: float,
    edge_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """circuit-tracer's ``prune_graph`` on a sparse adjacency: the kept nodes, the kept edges, cumulative scores.

    Nodes are ordered ``[features (n_features), errors, tokens and logits (n_tail)]`` as circuit-tracer's are.

    Args:
        adjacency: ``(n, n)`` sparse, ``adjacency[target, source]``.
        weights: ``(n,)`` the logit weights (zero except on logit nodes).
        n_features: the feature (here: neuron) nodes at the front.
        n_tail: the token and logit nodes at the end (always kept).
        node_threshold: keep the nodes carrying this fraction of the influence.
        edge_threshold: then keep the edges carrying this fraction of the edge influence.

    Returns:
        ``(node_mask (n,), edges (sparse (n, n), the kept entries of adjacency), cumulative scores (n,))``.

    Example:
        >>> # neuron 0 reads token 1; logit 2 reads the neuron (0.9) and the token (0.05)
        >>> a = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.9, 0.05, 0.0]]).to_sparse()
        >>> mask, edges, _ = prune_masks(a, torch.tensor([0.0, 0.0, 1.0]), 1, 2, 0.8, 0.9)
        >>> mask.tolist(), edges.to_dense()[2].tolist()    # the token's direct edge carries too little
        ([True, True, True], [0.8999999761581421, 0.0, 0.0])
    """
    a = adjacency.coalesce()
    n = a.shape[0]
    scores = node_influence(a, weights)
    node_mask = scores >= find_threshold(scores, node_threshold)
    node_mask[n - n_tail :] = True
    target, source = a.indices()
    inside = node_mask[target] & node_mask[source]
    pruned = sparse(a.indices()[:, inside], a.values()[inside], a.shape).coalesce()
    edge = edge_scores(pruned, weights)
    cut = find_threshold(edge.values(), edge_threshold, size=n * n)
    keep = edge.values() >= cut
    if float(cut) > 0:  # else circuit-tracer's mask is every pair, zeros too: no node loses its edges
        node_mask = _drop_unconnected(edge.indices(), keep, node_mask, n_features, n - n_tail)
    target, source = edge.indices()
    keep &= node_mask[target] & node_mask[source]
    values = pruned.values()[keep]  # pruned and edge share their coalesced indices
    edges = sparse(edge.indices()[:, keep], values, a.shape).coalesce()
    return node_mask, edges, _cumulative(scores)


def _drop_unconnected(
    indices: torch.Tensor, keep: torch.Tensor, node_mask: torch.Tensor, n_features: int, n_inner: int
) -> torch.Tensor:
    """Remove features and errors without a kept outgoing edge, and features without a kept incoming one, repeatedly."""
    node_mask = node_mask.clone()
    target, source = indices
    while True:
        alive = keep & node_mask[target] & node_mask[source]
        has_out = torch.zeros_like(node_mask).index_fill_(0, source[alive], True)
        has_in = torch.zeros_like(node_mask).index_fill_(0, target[alive], True)
        new = node_mask.clone()
        new[:n_inner] &= has_out[:n_inner]
        new[:n_features] &= has_in[:n_features]
        if torch.equal(new, node_mask):
            return node_mask
        node_mask = new


def _cumulative(scores: torch.Tensor) -> torch.Tensor:
    """Each node's share of the total influence carried by the nodes at least as influential (circuit-tracer's)."""
    ordered, order = torch.sort(scores, descending=True)
    out = torch.zeros_like(scores)
    out[order] = torch.cumsum(ordered, 0) / ordered.sum()
    return out


def predicted_change(
    adjacency: torch.Tensor, activation: torch.Tensor, layer: torch.Tensor, factor: torch.Tensor
) -> torch.Tensor:
    """The graph's linear prediction of every node's change when some nodes' activations are multiplied by a factor.

    Layer by layer, a node's change ``d`` moves each target ``t`` by ``sum_s (d_s / a_s) A[t, s]`` (an edge is
    ``a_s`` times the derivative); a node multiplied by ``f`` changes by ``(f - 1) a + f d`` where ``d`` is what
    reaches it (``-a`` for ``f = 0``: zero-ablation), as a patch of its live activation does.

    Args:
        adjacency: ``(n, n)`` sparse.
        activation: ``(n,)`` node activations (non-zero where a node is a target or multiplied).
        layer: ``(n,)`` node layers (tokens ``-1``, logits the number of layers).
        factor: ``(n,)`` the factor on each node's activation (1 for the nodes left alone).

    Returns:
        ``(n,)`` each node's change.

    Example:
        >>> a = torch.tensor([[0.0, 0.0], [3.0, 0.0]]).to_sparse()     # node 0 (a = 2) writes 3 into node 1
        >>> predicted_change(a, torch.tensor([2.0, 1.0]), torch.tensor([0, 1]), torch.tensor([0.0, 1.0]))
        tensor([-2., -3.])
    """
    dtype = adjacency.dtype
    factor, activation = factor.to(dtype), activation.to(dtype)
    safe = torch.where(activation != 0, activation, torch.ones_like(activation))
    total = torch.zeros_like(activation)
    for value in torch.unique(layer).tolist():
        here = layer == value
        reached = torch.mv(adjacency, total / safe)
        own = (factor - 1) * activation + factor * reached
        total = torch.where(here, own, total)
    return total


def value_gradients(probs: torch.Tensor, grads: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Gradients of frozen attention's values from its mixed output's, for many rows in one batched product.

    With the probabilities ``P`` held, a head's output is ``P @ V`` (``V`` its key/value head's values, shared by
    ``heads // kv_heads`` query heads), so ``dV = sum over the group of P^T @ dout``. The rows are folded into the
    product's columns: ``P`` is read once for all of them, never copied per row.

    Args:
        probs: ``(1, heads, T, T)`` attention probabilities of one prompt.
        grads: ``(rows, T, heads * head_dim)`` gradients of the mixed values (the output projection's input).
        heads: query heads.
        kv_heads: key/value heads (``heads`` without grouped-query attention).

    Returns:
        ``(rows, T, kv_heads * head_dim)`` gradients of the values (the value projection's output).

    Example:
        >>> probs = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])   # one head, two positions
        >>> value_gradients(probs, torch.tensor([[[1.0], [2.0]]]), 1, 1)   # P^T @ [1, 2]
        tensor([[[1.5000],
                 [1.5000]]])
    """
    rows, positions, width = grads.shape
    dim = width // heads
    folded = grads.reshape(rows, positions, heads, dim).permute(2, 1, 0, 3).reshape(heads, positions, rows * dim)
    mixed = probs[0].transpose(-1, -2).to(grads.dtype) @ folded  # (heads, T, rows * dim)
    summed = mixed.reshape(kv_heads, heads // kv_heads, positions, rows * dim).sum(1)
    return summed.reshape(kv_heads, positions, rows, dim).permute(2, 1, 0, 3).reshape(rows, positions, kv_heads * dim)


def top_entries(
    block: torch.Tensor, start: int, width: int, keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's ``keep`` largest entries by magnitude of a block of sources, and the block's ``sum |entry|``.

    Args:
        block: ``(T, n)`` products of one row, position by position.
        start: the source column of ``block[0, 0]``.
        width: source columns per position (``n``, or more where columns after the block's follow at each position).
        keep: entries kept.

    Returns:
        ``(columns (k,), values (k,), abs_sum () float64)``, unordered, with ``k = min(keep, T * n)``.

    Example:
        >>> top_entries(torch.tensor([[0.5, -2.0], [1.0, 0.0]]), 10, 3, 2)
        (tensor([11, 13]), tensor([-2.,  1.]), tensor(3.5000, dtype=torch.float64))
    """
    n = block.shape[-1]
    flat = block.flatten()
    index = torch.topk(flat.abs(), min(keep, flat.numel()), sorted=False).indices
    index = index.sort().values
    columns = start + torch.div(index, n, rounding_mode="floor") * width + index % n
    return columns, flat.gather(0, index), flat.abs().sum().double()


def merged_entries(
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``keep`` largest entries of all blocks' kept ones (:func:`top_entries` of each), largest first.

    Args:
        blocks: ``(columns (rows, k), values (rows, k), abs_sums (rows,))`` per block of sources.
        keep: entries kept per row.

    Returns:
        ``(columns (rows, k), values (rows, k), abs_sums (rows,) float64)`` as :func:`kept_entries` gives them.

    Example:
        >>> a = (torch.tensor([[1, 0]]), torch.tensor([[-2.0, 0.5]]), torch.tensor([2.5], dtype=torch.float64))
        >>> b = (torch.tensor([[5]]), torch.tensor([[1.0]]), torch.ones(1))
        >>> columns, values, sums = merged_entries([a, b], 2)
        >>> columns.tolist(), values.tolist(), sums.tolist()
        ([[1, 5]], [[-2.0, 1.0]], [3.5])
    """
    columns = torch.cat([b[0] for b in blocks], 1)
    values = torch.cat([b[1] for b in blocks], 1)
    sums = torch.stack([b[2].double() for b in blocks]).sum(0)
    if values.shape[1] > keep:
        top = torch.topk(values.abs(), keep, dim=1, sorted=False).indices
        columns, values = columns.gather(1, top), values.gather(1, top)
    order = torch.sort(values.abs(), dim=1, descending=True, stable=True).indices
    return columns.gather(1, order), values.gather(1, order), sums
