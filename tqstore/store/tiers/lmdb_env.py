"""One LMDB environment as the LMDB tier uses it: transactions, map growth, the free-disk guard,
compaction and the fork guard. The data layout lives in lmdb.py.

Rules from py-lmdb 3.0 / LMDB 0.9 (docs/tiers.md explains them):
- all writes on one writer thread; reads in short transactions on the caller's thread;
- `set_mapsize` invalidates every open transaction of the process, so it runs under the
  exclusive side of a gate that every transaction holds shared;
- MapFullError -> grow the map (double, bounded by the free disk) and retry; MapResizedError
  (another process grew it) -> `set_mapsize(0)` and retry;
- `reader_check()` at open; never use an environment in a forked child.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from tqstore.config import Config
from tqstore.units import MiB, format_size
from tqstore.durable import fsync_dir
from tqstore.errors import ConflictError, DiskFull, FormatVersionTooNew, StoreDamaged, TqstoreError
from tqstore.store.tiers.lmdb_records import schema_number
from tqstore.store.tiers.writer import ResizeGate, WriterThread

T = TypeVar("T")

log = logging.getLogger("tqstore.store")

DEFAULT_MIN_FREE_DISK = Config.min_free_disk_bytes

_MAX_TXN_ATTEMPTS = 16
_META_PAGES = 2  # LMDB's two meta pages, at the start of every file
_SMALL_DISK_SHARE = 20  # the default free-disk margin is at most 1/20 of the disk
_MAX_READERS = 510  # the default 126 slots run out with many threads in several processes
# LMDB 0.9's meta page (native byte order; 64-bit size_t): after the 16-byte page header, magic
# u32, version u32, address, map size, two 48-byte MDB_db records (the free one's first u32 is
# the page size), last page number, transaction id.
_META_MAGIC = 0xBEEFC0DE
_META_HEAD = struct.Struct("=II")
_META_PSIZE_AT, _META_TAIL_AT = 40, 136
_META_TAIL = struct.Struct("=QQ")
_META_BYTES = _META_TAIL_AT + _META_TAIL.size
# LMDB 0.9 sizes lock.mdb as (max readers - 1) reader slots plus its header, each 64 bytes
# (a cache line): 2 header lines and the first slot.
_LOCK_FILE_BYTES = (_MAX_READERS - 1) * 64 + 3 * 64


class LmdbEnv:
    """An open environment with named databases `dbs`, used through `read` and `write`."""

    def __init__(
        self, path: Path, db_names: tuple[bytes, ...], schema_version: int, map_size: int,
        min_free_disk_bytes: int,
    ) -> None:
        self.path = path
        self.min_free_disk_bytes = min_free_disk_bytes
        self._db_names = db_names
        self._schema_version = schema_version
        self._pid = os.getpid()
        self._closed = False
        self._gate = ResizeGate()
        self._open_fd = hold_open_lock(path)
        try:
            self._env, self.dbs = self._open(map_size)
        except BaseException:
            release_open_lock(self._open_fd)
            raise
        # Never closed while the environment is open: closing any descriptor of lock.mdb drops
        # every fcntl lock this process holds on it, LMDB's own liveness locks included.
        self._lock_fd = os.open(path / "lock.mdb", os.O_RDWR)
        if lock_holder(self._lock_fd) is None:  # alone: no compaction of another process is running
            self._remove_stale_copies()
        self._writer = WriterThread(f"tqstore-lmdb-writer:{path}")

    def check_usable(self) -> None:
        """Raise unless this process opened the environment and it is still open."""
        if self._pid != os.getpid():
            raise TqstoreError(
                f"the LMDB store at {self.path} was opened by process {self._pid} before it forked; "
                "LMDB environments must not be used across fork(): open the store in the child "
                "(use multiprocessing's 'spawn' start method) or open it only after forking"
            )
        if self._closed:
            raise TqstoreError(f"the LMDB store at {self.path} is closed: open it again")

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn(txn)` in a short read transaction on this thread; `fn` must copy what it
        returns (values are buffers valid only inside the transaction)."""
        self.check_usable()
        for _ in range(_MAX_TXN_ATTEMPTS):
            try:
                with self._gate.shared(), self._env.begin(buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.Error as exc:
                raise lmdb_failure(self.path, exc) from exc
        raise TqstoreError(f"the LMDB store at {self.path} keeps being resized by another process: retry")

    def write(self, fn: Callable[..., T], *args: object, needed: int = 0) -> T:
        """Run `fn(txn, *args)` in one write transaction on the writer thread and return its
        result; `needed` (bytes the job writes) sizes the map growth if the map is full."""
        return self.write_soon(fn, *args, needed=needed).result()

    def write_soon(self, fn: Callable[..., T], *args: object, needed: int = 0) -> Future:
        """`write` without waiting: the Future holds its result or its exception."""
        self.check_usable()

        def job() -> T:
            for _ in range(_MAX_TXN_ATTEMPTS):
                try:
                    with self._gate.shared(), self._env.begin(write=True) as txn:
                        return fn(txn, *args)
                except lmdb.MapFullError:
                    self._grow_map(needed)
                except lmdb.MapResizedError:
                    self._adopt_map_size()
                except lmdb.Error as exc:
                    raise lmdb_failure(self.path, exc, needed) from exc
            raise TqstoreError(f"the LMDB store at {self.path} could not grow its map: retry")

        if threading.current_thread() is self._writer.thread:
            future: Future = Future()  # a job that writes again must not queue behind itself
            future.set_result(job())
            return future
        return self._writer.submit(job)

    def check_free_disk(self, needed: int, txn: lmdb.Transaction | None = None) -> None:
        """DiskFull if writing `needed` bytes would leave less than the configured free space.

        Inside the write transaction `txn`, the free pages of the file count as room: LMDB fills
        them before it grows the file, and after an eviction or rm they are the only room a full
        disk has (the file never shrinks by itself). Pages that old readers still hold make this
        an estimate; if LMDB then meets a full disk, the commit fails as DiskFull all the same.
        """
        free = shutil.disk_usage(self.path).free
        room = free + (self._free_pages_bytes(txn) if txn is not None else 0)
        if needed and room - needed < self.free_margin():
            raise self._disk_full(needed, f"only {format_size(free)} is free")

    def free_margin(self) -> int:
        """The free space writes must leave: store.min_free_disk, except that the default
        (1 GiB) is at most 5% of the disk, so on a small disk an `rm` and `gc` make room again
        instead of every save being refused by a margin larger than anything they can free."""
        if self.min_free_disk_bytes != DEFAULT_MIN_FREE_DISK:
            return self.min_free_disk_bytes
        return min(self.min_free_disk_bytes, shutil.disk_usage(self.path).total // _SMALL_DISK_SHARE)

    def _free_pages_bytes(self, txn: lmdb.Transaction) -> int:
        """Bytes of the file's pages that no database uses (LMDB's free list)."""
        info, main = self._env.info(), self._env.stat()
        used = _pages(main) + sum(_pages(txn.stat(db)) for db in self.dbs.values())
        return max(0, info["last_pgno"] + 1 - _META_PAGES - used) * main["psize"]

    def info(self) -> tuple[int, int, int]:
        """(data.mdb size, map size, page size)."""
        self.check_usable()
        with self._gate.shared():  # compaction swaps the environment under the exclusive side
            return (self.path / "data.mdb").stat().st_size, self._env.info()["map_size"], self._env.stat()["psize"]

    def main_db_stat(self) -> dict[str, int]:
        """Page counts of the main database (which holds the named databases' records)."""
        return self._env.stat()

    def compact(self) -> tuple[int, int]:
        """Rewrite data.mdb without free pages; returns its size before and after.

        Copies compactly to a temp file in the same folder, then atomically replaces data.mdb and
        reopens. Refused (ConflictError) if another process has the environment open. Processes
        that open it meanwhile wait for the compaction to end (`hold_open_lock`): one that
        committed during the copy would lose its writes with the old file, and one that opened
        between the replace and the reopen would read the new file with the old file's
        transaction id from lock.mdb (LMDB then sees the copy's empty meta page, and its first
        commit empties the store).
        """
        self.check_usable()
        return self._writer.run(self._compact)

    def close(self) -> None:
        """Finish queued writes and close. In a forked child, only forget the environment."""
        if self._closed or self._pid != os.getpid():
            self._closed = True  # a child must not close the parent's environment (its slots)
            return
        self._closed = True
        self._writer.stop()
        with self._gate.exclusive():
            self._env.close()
            os.close(self._lock_fd)
            release_open_lock(self._open_fd)

    # --- internals -----------------------------------------------------------------------------

    def _open_dbs(self, env: lmdb.Environment) -> tuple[dict[bytes, object], bytes | None]:
        """The named databases, and the stored schema version (written if the store is new)."""
        dbs = {name: env.open_db(name) for name in self._db_names}
        with env.begin(write=True) as txn:
            found = txn.get(b"schema", db=dbs[b"meta"])
            if found is None:
                txn.put(b"schema", str(self._schema_version).encode(), db=dbs[b"meta"])
        return dbs, found

    def _open(self, map_size: int) -> tuple[lmdb.Environment, dict[bytes, object]]:
        check_data_file(self.path)
        reserve_lock_file(self.path)
        try:
            env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=len(self._db_names) + 2,
                max_readers=_MAX_READERS,
            )
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc) from exc
        try:
            env.reader_check()  # free the reader slots left by killed processes
            try:
                dbs, found = self._open_dbs(env)
            except lmdb.MapResizedError:  # another process grew the map while this one opened it
                env.set_mapsize(0)
                dbs, found = self._open_dbs(env)
        except lmdb.Error as exc:
            env.close()  # or this process could never open it again
            raise lmdb_failure(self.path, exc) from exc
        version = schema_number(found)  # None if damaged: listed by verify, rewritten by repair
        if version is not None and version > self._schema_version:
            env.close()
            raise FormatVersionTooNew(
                f"the LMDB store at {self.path} has layout version {version}, newer than this "
                f"tqstore's {self._schema_version}: upgrade tqstore, or use another --home. If no newer "
                "tqstore ever wrote to it, the version record is damaged: `tqstore repair` checks that every "
                "record is of this layout and sets it back"
            )
        return env, dbs

    def _grow_map(self, needed: int) -> None:
        with self._gate.exclusive():
            current = self._env.info()["map_size"]
            new = next_map_size(
                current, needed, (self.path / "data.mdb").stat().st_size,
                shutil.disk_usage(self.path).free, self.free_margin(),
            )
            if new is None:
                raise self._disk_full(needed, "the LMDB map cannot grow past the free disk")
            self._env.set_mapsize(new)

    def _adopt_map_size(self) -> None:
        with self._gate.exclusive():
            check_data_file(self.path)
            self._env.set_mapsize(0)  # another process grew the map: adopt its size

    def _disk_full(self, needed: int, why: str) -> DiskFull:
        return DiskFull(
            f"cannot write {format_size(needed)} to the LMDB store at {self.path}: {why}, and "
            f"tqstore keeps {format_size(self.free_margin())} free (store.min_free_disk). "
            "Free space on that disk, lower store.lmdb_budget, or run `tqstore gc`; to keep less free, "
            "lower the margin: `tqstore config set store.min_free_disk 100MiB` (or TQSTORE_MIN_FREE_DISK, 0 for none)"
        )

    def _compact(self) -> tuple[int, int]:
        data = self.path / "data.mdb"
        with self._gate.exclusive():
            self._refuse_if_shared()
            with self._alone():
                return self._compact_alone(data)

    @contextmanager
    def _alone(self) -> Iterator[None]:
        """The open lock held exclusively: no other process opens the environment until it ends."""
        if self._open_fd is None:
            raise ConflictError(f"cannot lock the LMDB store at {self.path} for its compaction (read-only folder?)")
        try:
            fcntl.flock(self._open_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._open_fd, fcntl.LOCK_SH)  # a failed conversion drops the shared lock (Linux)
            raise ConflictError(
                f"another process has the LMDB store at {self.path} open; compaction needs it alone: "
                "stop the other tqstore processes (e.g. `tqstore serve`) and run it again"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(self._open_fd, fcntl.LOCK_SH)

    def _compact_alone(self, data: Path) -> tuple[int, int]:
        self._remove_stale_copies()
        before = data.stat().st_size
        with self._env.begin() as txn:  # the compact copy holds the pages in use, no free ones
            used = _pages(self._env.stat()) + sum(_pages(txn.stat(db)) for db in self.dbs.values())
        # The copy needs room for the pages in use, nothing more: it replaces the file and so
        # frees space, which a full disk needs most (the min_free_disk margin does not apply).
        needed = (used + _META_PAGES) * self._env.stat()["psize"]
        free = shutil.disk_usage(self.path).free
        if free < needed:
            raise DiskFull(f"compacting the LMDB store at {self.path} needs {format_size(needed)} free for its copy "
                           f"of the data in use, and only {format_size(free)} is free: the store works without "
                           "it; free space on that disk and run `tqstore gc --compact` again")
        tmp = self.path / f".data.mdb.{secrets.token_hex(6)}.compact"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                self._env.copyfd(fd, compact=True)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._refuse_if_shared()  # opened during the copy: its writes would be lost
            map_size = self._env.info()["map_size"]
            os.replace(tmp, data)
            fsync_dir(self.path)
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc, before) from exc
        finally:
            tmp.unlink(missing_ok=True)
        self._env.close()
        self._env, self.dbs = self._open(map_size)
        return before, data.stat().st_size

    def _remove_stale_copies(self) -> None:
        """Delete the copies of compactions killed before they replaced data.mdb (each as large as
        the live data); called only when no other process has the environment open."""
        for stale in self.path.glob(".data.mdb.*.compact"):
            stale.unlink(missing_ok=True)

    def _refuse_if_shared(self) -> None:
        pid = lock_holder(self._lock_fd)
        if pid is not None:
            raise ConflictError(
                f"process {pid} has the LMDB store at {self.path} open; compaction needs it alone: "
                "stop the other tqstore processes (e.g. `tqstore serve`) and run it again"
            )


def next_map_size(current: int, needed: int, file_bytes: int, free_bytes: int, min_free: int) -> int | None:
    """The map size to grow to after MapFullError, or None if the disk cannot hold more.

    Doubles (or makes room for twice `needed` if more), capped at what the file can reach while
    leaving `min_free` bytes free; rounded up to whole MiB (a multiple of every OS page size).
    """
    cap = file_bytes + max(0, free_bytes - min_free)
    new = min(max(2 * current, current + 2 * needed), cap)
    new = -(-new // MiB) * MiB
    return new if new > current else None


def check_data_file(path: Path) -> None:
    """StoreDamaged unless data.mdb in `path` is as long as its newest commit says.

    LMDB maps the file and trusts its meta pages: a page past the end of a truncated file kills
    the process with SIGBUS at the first read, before any error can be raised. So the file's
    size is checked against (last page number + 1) x page size of the newer valid meta page
    before every mapping. A missing file is a new store; an empty one is a store that lost
    everything (LMDB writes its two meta pages as it creates the file), unless another process
    is creating it right now.
    """
    data = path / "data.mdb"
    try:
        fd = os.open(data, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            if _being_created(path):
                return
            raise _damaged(data, "it is empty (0 bytes), so every entry it held is lost (LMDB writes two meta pages "
                                 "as it creates the file)")
        first = os.pread(fd, _META_BYTES, 0)
        psize = _meta_page_size(first)
        if psize is None:
            raise _damaged(data, f"it does not start with an LMDB meta page ({size} bytes)")
        metas = [m for m in (_meta(first), _meta(os.pread(fd, _META_BYTES, psize))) if m is not None]
        if size < 2 * psize or not metas:
            raise _damaged(data, f"it holds {size} bytes, less than its two meta pages")
        last_page, _ = max(metas, key=lambda m: m[1])
        needed = (last_page + 1) * psize
        if size < needed:
            raise _damaged(data, f"it is truncated: {format_size(size)} ({size} bytes) of the {needed} bytes its "
                                 "last commit wrote")
    finally:
        os.close(fd)


def reserve_lock_file(path: Path) -> None:
    """Give lock.mdb in `path` its disk blocks before LMDB maps it; DiskFull if the disk has none.

    LMDB extends a new lock.mdb with ftruncate, which makes a sparse file, and then writes
    through its mapping: on a full disk the first write kills the process with SIGBUS. Blocks
    that are already allocated are left as they are, so this is safe while other processes use
    the file.
    """
    if not hasattr(os, "posix_fallocate"):
        return  # (macOS has no such call) LMDB opens as before
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # unreadable or read-only folder: LMDB's own open reports it
    try:
        os.posix_fallocate(fd, 0, _LOCK_FILE_BYTES)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return  # a filesystem without fallocate: LMDB opens as before
        raise DiskFull(
            f"cannot create the LMDB store's lock file in {path}: the disk is full ({format_size(_LOCK_FILE_BYTES)} "
            "needed). Free space on that disk, or use another --home"
        ) from None
    finally:
        os.close(fd)


def _being_created(path: Path) -> bool:
    """Whether another process holds the environment in `path` open: LMDB takes lock.mdb before
    it creates data.mdb and keeps others out until the meta pages are written."""
    try:
        fd = os.open(path / "lock.mdb", os.O_RDONLY)
    except OSError:
        return False
    try:
        return lock_holder(fd) is not None
    finally:
        os.close(fd)


def _meta_page_size(page: bytes) -> int | None:
    if len(page) < _META_BYTES or _META_HEAD.unpack_from(page, 16)[0] != _META_MAGIC:
        return None
    (psize,) = struct.unpack_from("=I", page, _META_PSIZE_AT)
    return psize if 512 <= psize <= 1 << 16 and psize & (psize - 1) == 0 else None


def _meta(page: bytes) -> tuple[int, int] | None:
    """(last page number, transaction id) of a valid meta page."""
    if _meta_page_size(page) is None:
        return None
    return _META_TAIL.unpack_from(page, _META_TAIL_AT)


def _damaged(data: Path, why: str) -> StoreDamaged:
    return StoreDamaged(
        f"the LMDB store file {data} is damaged: {why}. Reading it would crash, so tqstore refuses it. "
        f"Recover with `tqstore repair`, which moves the folder {data.parent} aside, starts a new one and copies "
        "into it every entry that can still be read whole (`tqstore pull` or save the others again), or restore "
        "data.mdb from a backup"
    )


def _full_disk_message(path: Path, message: str, needed: int) -> bool:
    """Whether an LMDB error text means a full disk. LMDB 0.9 reports a short write, which is
    how a full disk usually shows, as EIO ("Input/output error"): that counts when the disk has
    no room for what was being written; quotas and file size limits count always."""
    if any(os.strerror(code) in message for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)):
        return True
    if os.strerror(errno.EIO) not in message:
        return False
    try:
        return shutil.disk_usage(path).free < max(needed, MiB)
    except OSError:
        return False


def _pages(stat: dict[str, int]) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]


OPEN_LOCK = "open.lock"


def hold_open_lock(path: Path) -> int | None:
    """A descriptor holding the shared side of `path`/open.lock, which every process holds for as
    long as it has the environment open and a compaction holds exclusively; waits (with a
    warning) while another process compacts. None where the file can be neither created nor
    opened (a read-only folder): LMDB's own open then reports why."""
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(path / OPEN_LOCK, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
            break
        except OSError:
            continue
    if fd is None:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process to finish compacting the LMDB store at %s", path)
            fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_open_lock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # releases the flock


def lock_holder(fd: int) -> int | None:
    """The pid of another process that has the environment open, if any.

    LMDB holds a shared fcntl lock on byte 0 of lock.mdb for as long as a process has the
    environment open, so an F_GETLK probe for a write lock names another user. struct flock
    differs per OS; elsewhere None is returned (the check is skipped).
    """
    if sys.platform.startswith("linux"):
        fmt = "hhqqi4x"  # type, whence, start, len, pid
        probe = struct.pack(fmt, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        kind, _, _, _, pid = struct.unpack(fmt, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    elif sys.platform == "darwin":
        fmt = "qqihh"  # start, len, pid, type, whence
        probe = struct.pack(fmt, 0, 1, 0, fcntl.F_WRLCK, os.SEEK_SET)
        _, _, pid, kind, _ = struct.unpack(fmt, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    else:
        return None
    return None if kind == fcntl.F_UNLCK else pid


def lmdb_failure(path: Path, exc: lmdb.Error, needed: int = 0) -> TqstoreError:
    """The tqstore error for an LMDB failure (no lmdb exception leaves the tier)."""
    if isinstance(exc, lmdb.DiskError) or _full_disk_message(path, str(exc), needed):
        return DiskFull(
            f"the disk holding the LMDB store at {path} is full ({format_size(needed)} to write): "
            "free space on that disk, lower store.lmdb_budget, or run `tqstore gc`"
        )
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.PanicError)):
        return StoreDamaged(
            f"the LMDB store at {path} is damaged ({exc}): run `tqstore repair`, which moves it aside and keeps every "
            "entry that can still be read whole"
        )
    if "already open" in str(exc):
        return TqstoreError(f"the LMDB store at {path} is already open in this process under another path")
    if os.strerror(errno.EROFS) in str(exc):  # LMDB writes its lock file even to read
        return TqstoreError(f"the LMDB store at {path} is on a read-only file system, and tqstore writes its lock "
                            "files even to read it: use a writable --home (a copy of this one, say)")
    if os.strerror(errno.EACCES) in str(exc):
        return TqstoreError(f"the LMDB store at {path} cannot be opened: permission denied ({exc}); check the "
                            "folder's permissions, or use another --home")
    return TqstoreError(f"the LMDB store at {path} failed: {exc}")
