"""Durable file writes outside LMDB: readers see the old file or the whole new one, never a part.

A uniquely named temporary file (O_EXCL, so concurrent writers never share one) in the same
folder is written, flushed to the device (F_FULLFSYNC on macOS, where fsync leaves data in the
drive cache), renamed over the target, and the folder is synced so the rename survives a crash.
"""

from __future__ import annotations

import errno
import os
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path

from tqstore.errors import DiskFull


def write_file_atomic(path: str | os.PathLike, data: bytes | Iterable[bytes]) -> None:
    """Replace `path` with `data` (bytes or an iterable of chunks); a full disk raises DiskFull
    and a failure of any kind leaves no temporary file behind."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                full_fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"no space left writing {path}: free some space or write somewhere else") from e
        if e.filename == str(tmp):  # the temporary name is ours: the error is about the caller's path
            raise type(e)(e.errno, e.strerror, str(path)) from e
        raise


def write_cache_file(path: str | os.PathLike, data: bytes) -> bool:
    """`write_file_atomic` for a file that only saves work (digests, verdicts, records): its folder
    is made, and a full disk skips it (False), so that reads keep working on a full disk."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, data)
    except DiskFull:
        return False
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        raise
    return True


def full_fsync(fd: int) -> bool | None:
    """fsync, or F_FULLFSYNC on macOS (falling back to fsync where a filesystem refuses it).
    Returns whether F_FULLFSYNC was honoured (None where the platform has none)."""
    if sys.platform == "darwin":
        import fcntl

        if hasattr(fcntl, "F_FULLFSYNC"):
            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return True
            except OSError:
                os.fsync(fd)  # some filesystems (network, FAT) refuse it
                return False
    os.fsync(fd)
    return None


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or a new file in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        full_fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and folder below `root` (a staged folder before it is renamed in)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath, name), os.O_RDONLY)
            try:
                full_fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
