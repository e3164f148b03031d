"""A shared/exclusive lock on a file (flock), held across processes and threads.

The store's home lock (tierset.py says what it orders) and the lock around the S3 tier's
manifest-version file (crypto.py) are both this. flock is released by the kernel when a process
dies, so a killed holder never blocks anyone.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class HomeLock:
    """Shared/exclusive flock on one file; each hold opens its own descriptor, so threads of
    one process exclude each other like processes do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held by operations that write objects and then a manifest referencing them."""
        with self._hold(fcntl.LOCK_SH):
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by operations that delete objects no manifest references."""
        with self._hold(fcntl.LOCK_EX):
            yield

    @contextmanager
    def _hold(self, mode: int) -> Iterator[None]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # releases the lock
