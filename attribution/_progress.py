"""The progress bars of long calls: shown on a terminal, once a call has run for a second (tqdm's ``delay``)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _chosen
from tqdm.std import tqdm as _text

T = TypeVar("T")

DELAY = 1.0  # seconds before a bar appears: a sweep of a fraction of a second prints nothing
NOTEBOOK = _chosen is not _text  # tqdm draws widgets in a Jupyter kernel: nothing is written to stderr


def shown(enabled: bool, file: Any = None) -> bool:
    """Whether a bar is drawn: ``enabled`` and ``file`` (default ``sys.stderr``) a terminal, or a notebook's widget."""
    if not enabled:
        return False
    if NOTEBOOK:
        return True
    isatty = getattr(sys.stderr if file is None else file, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def progress(items: Iterable[T], *, desc: str, enabled: bool, **options: Any) -> Iterator[T]:
    """``items`` with a tqdm bar (removed when done) that appears after :data:`DELAY` seconds, if ``enabled``.

    ``enabled`` (every ``progress=True`` of the public functions) asks for a bar where one can be read: on a
    terminal, or as a widget in a Jupyter notebook. When stderr is redirected to a file or a pipe, no bar is drawn
    even with ``enabled=True``: a bar redraws itself with carriage returns, which in a log file become hundreds of
    partial lines between the printed results. There is no switch that forces bars into a redirected stream; a
    caller who wants to follow a long redirected run can print its own lines.

    Example:
        >>> list(progress(range(3), desc="quick", enabled=True))
        [0, 1, 2]
    """
    options.setdefault("leave", False)
    disable = not shown(enabled, options.get("file"))
    return iter(tqdm(items, desc=desc, disable=disable, delay=DELAY, **options))
