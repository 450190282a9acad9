"""The progress bars of long calls: shown only once a call has run for a second (tqdm's ``delay``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

DELAY = 1.0  # seconds before a bar appears: a sweep of a fraction of a second prints nothing


def progress(items: Iterable[T], *, desc: str, enabled: bool, **options: Any) -> Iterator[T]:
    """``items`` with a tqdm bar (removed when done) that appears after :data:`DELAY` seconds, if ``enabled``.

    Example:
        >>> list(progress(range(3), desc="quick", enabled=True))
        [0, 1, 2]
    """
    options.setdefault("leave", False)
    return iter(tqdm(items, desc=desc, disable=not enabled, delay=DELAY, **options))
