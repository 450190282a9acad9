"""Pure region math for incremental inference: which outputs a changed input box reaches, which inputs they read."""

from __future__ import annotations

Span = tuple[int, int]
"""A half-open index range ``[start, stop)`` along one spatial dimension."""


def reached(span: Span, kernel: int, stride: int, padding: int, dilation: int, size: int) -> Span:
    """The output indices of a sliding window op (conv, pool) whose window reads an input in ``span``."""
    a, b = span
    lo = -(-(a + padding - dilation * (kernel - 1)) // stride)  # ceil division
    hi = (b - 1 + padding) // stride + 1
    return max(lo, 0), min(hi, size)


def read(span: Span, kernel: int, stride: int, padding: int, dilation: int) -> Span:
    """The input indices (possibly outside the input: padding) that the outputs in ``span`` read."""
    lo, hi = span
    return lo * stride - padding, (hi - 1) * stride - padding + dilation * (kernel - 1) + 1


def union(first: Span, second: Span) -> Span:
    """The smallest span holding both."""
    return min(first[0], second[0]), max(first[1], second[1])


def widened(span: Span, length: int, size: int) -> Span:
    """A span of ``length`` inside ``[0, size)`` holding ``span`` (``length`` at least its own, at most ``size``).

    It keeps the start where it can and moves back from the end; an empty span is placed at its start.
    """
    start = min(max(span[0], 0), size - length)
    return start, start + length
