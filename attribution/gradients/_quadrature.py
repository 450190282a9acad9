"""Where the path methods evaluate the gradient on the path, with what weights, a chunk of nodes a forward.

The integral ``int_0^1 g(a) da`` is approximated by ``sum_k w_k g(a_k)``. The rules and their nodes are those of
captum 0.9 (``captum.attr._utils.approximation_methods``), so that attributions agree with captum's:

* ``"gausslegendre"``: Gauss-Legendre nodes and weights (``numpy.polynomial.legendre.leggauss``) moved from
  ``[-1, 1]`` to ``[0, 1]``: ``a = (1 + t) / 2``, ``w = w_t / 2``; exact for polynomials of degree ``2 n - 1``.
* ``"riemann_left"`` / ``"riemann_right"`` / ``"riemann_middle"``: ``n`` equal weights ``1 / n`` at the left ends,
  right ends or midpoints of ``n`` equal intervals.
* ``"riemann_trapezoid"``: ``n`` nodes ``linspace(0, 1, n)`` with weights ``1 / n``, halved at both ends, as captum
  does; the weights sum to ``(n - 1) / n``, not 1 (the textbook rule would use ``1 / (n - 1)``), so the rule
  converges like the one-sided ones, at ``O(1 / n)``.

Every path method (Integrated Gradients, layer conductance, internal influence, neuron conductance, neuron
Integrated Gradients) walks the straight path ``start + a_k (end - start)`` with :func:`path_chunks`, a chunk of nodes
a forward, and those that weigh the gradients sum them with :func:`integrate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid")
"""The names ``method=`` accepts."""


def check_rule(method: str, steps: int) -> None:
    """Reject an unknown ``method`` or too few ``steps`` before anything runs."""
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(repr(m) for m in METHODS)}; got {method!r}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"`steps` must be an integer; got {type(steps).__name__}")
    least = 2 if method == "riemann_trapezoid" else 1
    if steps < least:
        raise ValueError(f"`steps` must be at least {least} for method={method!r}; got {steps}")


def nodes_and_weights(method: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(steps,)`` float64 nodes ``a_k`` in ``[0, 1]`` and weights ``w_k`` of a rule (see the module docs).

    Example:
        >>> a, w = nodes_and_weights("riemann_middle", 4)
        >>> a.tolist(), w.tolist()
        ([0.125, 0.375, 0.625, 0.875], [0.25, 0.25, 0.25, 0.25])
    """
    check_rule(method, steps)
    n = steps
    if method == "gausslegendre":
        t, w = np.polynomial.legendre.leggauss(n)
        return torch.from_numpy(0.5 * (1 + t)), torch.from_numpy(0.5 * w)
    weights = torch.full((n,), 1 / n, dtype=torch.float64)
    if method == "riemann_trapezoid":
        weights[0] /= 2
        weights[-1] /= 2
        return torch.linspace(0, 1, n, dtype=torch.float64), weights
    ends = {"riemann_left": (0, 1 - 1 / n), "riemann_right": (1 / n, 1), "riemann_middle": (0.5 / n, 1 - 0.5 / n)}
    start, end = ends[method]
    return torch.linspace(start, end, n, dtype=torch.float64), weights


def nodes_per_forward(internal_batch_size: int | None, nodes: int, items: int) -> int:
    """How many path nodes one forward takes: ``internal_batch_size // items``, at least one; ``None``: all.

    Example:
        >>> nodes_per_forward(None, 7, 4), nodes_per_forward(9, 7, 4), nodes_per_forward(3, 7, 4)
        (7, 2, 1)
    """
    return nodes if internal_batch_size is None else max(1, internal_batch_size // items)


def path_chunks(
    start: torch.Tensor, end: torch.Tensor, alphas: torch.Tensor, per: int
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The straight path ``start + a (end - start)`` at the nodes ``alphas``, ``per`` nodes at a time.

    Yields ``(nodes, rows)``: the points at the nodes ``alphas[nodes]``, step-major ``(k * batch, ...)`` (every item
    at the chunk's first node, then every item at the next), in ``end``'s dtype and on its device.

    Example:
        >>> chunks = path_chunks(torch.zeros(1), torch.ones(1), torch.tensor([0.25, 0.5, 1.0]), 2)
        >>> [(nodes, rows.tolist()) for nodes, rows in chunks]
        [(slice(0, 2, None), [0.25, 0.5]), (slice(2, 3, None), [1.0])]
    """
    steps = alphas.shape[0]
    alphas = alphas.to(device=end.device, dtype=end.dtype)
    shape = (-1,) + (1,) * end.dim()
    for first in range(0, steps, per):
        nodes = slice(first, min(first + per, steps))
        yield nodes, (start[None] + alphas[nodes].view(shape) * (end - start)[None]).flatten(0, 1)


def integrate(
    gradient: Callable[[torch.Tensor, int], torch.Tensor],
    start: torch.Tensor,
    end: torch.Tensor,
    alphas: torch.Tensor,
    weights: torch.Tensor,
    per: int,
) -> torch.Tensor:
    """``sum_k w_k g(start + a_k (end - start))``, ``per`` nodes a forward (:func:`path_chunks`).

    ``gradient(rows, k)`` takes a chunk's ``(k * batch, ...)`` step-major rows and returns the gradients there as
    ``(k, ...)``; the weights are cast to the gradients' dtype and device.

    Example:
        >>> a, w = nodes_and_weights("gausslegendre", 3)
        >>> x = torch.tensor([[2.0]], dtype=torch.float64)
        >>> integrate(lambda rows, k: 3 * rows.view(k, 1, 1) ** 2, torch.zeros_like(x), x, a, w, 2)  # int_0^1 3 (2a)^2
        tensor([[4.0000]], dtype=torch.float64)
    """
    total: torch.Tensor | None = None
    for nodes, rows in path_chunks(start, end, alphas, per):
        grad = gradient(rows, nodes.stop - nodes.start)
        w = weights[nodes].to(device=grad.device, dtype=grad.dtype)
        part = (grad * w.view((-1,) + (1,) * (grad.dim() - 1))).sum(0)
        total = part if total is None else total + part
    assert total is not None
    return total
