"""Where Integrated Gradients evaluates the gradient on the path, and with what weights: pure tensor math.

The integral ``int_0^1 g(a) da`` is approximated by ``sum_k w_k g(a_k)``. The rules and their nodes are those of
captum 0.9 (``captum.attr._utils.approximation_methods``), so that attributions agree with captum's:

* ``"gausslegendre"``: Gauss-Legendre nodes and weights (``numpy.polynomial.legendre.leggauss``) moved from
  ``[-1, 1]`` to ``[0, 1]``: ``a = (1 + t) / 2``, ``w = w_t / 2``; exact for polynomials of degree ``2 n - 1``.
* ``"riemann_left"`` / ``"riemann_right"`` / ``"riemann_middle"``: ``n`` equal weights ``1 / n`` at the left ends,
  right ends or midpoints of ``n`` equal intervals.
* ``"riemann_trapezoid"``: ``n`` nodes ``linspace(0, 1, n)`` with weights ``1 / n``, halved at both ends, as captum
  does; the weights sum to ``(n - 1) / n``, not 1 (the textbook rule would use ``1 / (n - 1)``), so the rule
  converges like the one-sided ones, at ``O(1 / n)``.
"""

from __future__ import annotations

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
