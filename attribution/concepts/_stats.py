"""The significance test of TCAV: a two-sided t-test of two samples, with the t distribution computed here.

Pure Python floats (``math``): no scipy. The two-sided p-value of ``t`` with ``df`` degrees of freedom is the
regularised incomplete beta function ``I_{df / (df + t^2)}(df / 2, 1 / 2)``, evaluated by its continued fraction
(modified Lentz), accurate to about ``1e-14``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Test = Literal["student", "welch"]


def t_test(a: Sequence[float], b: Sequence[float], test: Test = "student") -> float:
    """Two-sided p-value of the difference of the means of ``a`` and ``b``: Student's (pooled) or Welch's t-test.

    Equals ``scipy.stats.ttest_ind(a, b, equal_var=test == "student").pvalue``: ``nan`` when both samples are
    constant and equal (``t = 0 / 0``), ``0`` when they are constant and differ.

    Example:
        >>> round(t_test([1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0]), 6)
        0.070988
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a t-test needs at least two values per sample; got {len(a)} and {len(b)}")
    na, nb = len(a), len(b)
    ma, mb = math.fsum(a) / na, math.fsum(b) / nb
    va = math.fsum((x - ma) ** 2 for x in a) / (na - 1)
    vb = math.fsum((x - mb) ** 2 for x in b) / (nb - 1)
    if test == "student":
        df = float(na + nb - 2)
        se2 = ((na - 1) * va + (nb - 1) * vb) / df * (1 / na + 1 / nb)
    elif test == "welch":
        se2 = va / na + vb / nb
        df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1)) if se2 > 0 else float("nan")
    else:
        raise ValueError(f"`test` must be 'student' or 'welch'; got {test!r}")
    if se2 == 0:
        return float("nan") if ma == mb else 0.0
    return t_two_sided(abs(ma - mb) / math.sqrt(se2), df)


def t_two_sided(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t distribution with ``df`` (real, > 0) degrees of freedom.

    Example:
        >>> round(t_two_sided(2.0, 1.0), 12)   # Cauchy: 1 - 2 atan(2) / pi
        0.295167235301
    """
    if math.isinf(t):
        return 0.0
    return incomplete_beta(df / (df + t * t), df / 2, 0.5)


def incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)`` for ``0 <= x <= 1``, ``a, b > 0``.

    Example:
        >>> incomplete_beta(0.25, 1.0, 1.0), round(incomplete_beta(0.5, 2.0, 3.0), 12)
        (0.25, 0.6875)
    """
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):  # the continued fraction converges fast on this side; else use the symmetry
        return math.exp(log_front) * _continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _continued_fraction(1 - x, b, a) / b


def _continued_fraction(x: float, a: float, b: float, *, steps: int = 500, eps: float = 1e-16) -> float:
    """The continued fraction of ``I_x(a, b)`` (Numerical Recipes' ``betacf``), by the modified Lentz method."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, steps + 1):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    return h
