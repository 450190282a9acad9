"""One writer per output directory: an advisory lock on ``out/.lock``, held for the whole run.

The lock is ``fcntl.flock`` on a file in the directory: the kernel releases it when the process exits, however it
exits (``SIGKILL`` included), so a killed run never leaves a stale lock. The file itself stays (removing it would
let two processes lock two different files); it holds the process id and host of the last holder, which a refused
run names. ``flock`` is advisory and local to one machine's kernel on most network file systems: two machines that
share a folder over NFS are not kept apart by it.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = ".lock"
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here; runs are not guarded
    fcntl = None  # type: ignore[assignment]


class InUseError(RuntimeError):
    """Another process is writing to the output directory (:func:`attribute_dataset`'s ``out``).

    The runner holds an advisory lock (``fcntl.flock``) on a file in ``out`` while it writes; a second writer gets
    this error, naming the folder and the process that holds it, instead of mixing or losing results. The kernel
    releases the lock when the holder exits, however it ends. Catch it to wait and retry, or write elsewhere.
    """


@contextmanager
def writer(out: Path) -> Iterator[bool]:
    """Hold the lock of ``out`` while the body runs; yields False if ``out`` cannot be written (read-only).

    Raises:
        InUseError: another process holds the lock; the message names it.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in READ_ONLY:
            raise
        yield False
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
                raise InUseError(
                    f"`out` {str(out)!r} is in use by another run ({holder}, which holds {out / LOCK}): wait for it "
                    "to finish, or write to another directory. Two writers would mix or lose results"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def remove_stale(out: Path) -> None:
    """Delete the temporary files and shard directories of killed runs (only safe while holding the lock)."""
    for folder in (out, out / "shards"):
        if folder.is_dir():
            for stale in folder.glob("*.tmp-*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
