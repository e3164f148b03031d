"""Locks in the bucket, so that a remote gc never deletes what a push on another machine reuses.

A push decides which of the bucket's objects it reuses (from the manifests and packs it lists,
expired or removed entries' included) and references them only when its manifest is written,
seconds or minutes later; a remote gc decides what is unreferenced from its own listing. Neither
can see the other's decision in the bucket's data, so both write a lock object first:

    PREFIX/locks/push-<id>    shared: any number of pushes at once
    PREFIX/locks/gc-<id>      exclusive against pushes

Each writes its lock, then LISTs the locks (S3 lists a completed PUT at once: strong read-after-
write consistency). A push that finds a live gc lock deletes its own, waits and tries again; a
gc that finds a live push lock waits once, then deletes no object (it may still delete expired
manifests: that only makes it keep more next time). Of a push and a gc that overlap, whichever
LISTs second sees the other's lock, so they never both go on; and a gc takes its listing of the
manifests only after its lock check, so a push that finished before it is in that listing.

A lock is live while its Last-Modified is less than STALE seconds older than the lock its lister
has just written, both times the server's: machines' clocks do not matter. Holders write theirs
again every REFRESH seconds from a thread, and check before they commit (the push's manifest, the
gc's deletions) that the last rewrite is recent enough (`LockHolder.check`); a lock of a killed
process goes stale and is deleted by whoever lists it, at once when the lister runs on the same
machine (the lock names its process id and a digest of the host name and boot id) and finds that
process gone. A lock written by a process paused longer
than STALE (a laptop asleep mid-push) may be taken for stale: that process's `check` then fails
instead of committing. tqstores older than these locks write none: the gc grace (maintenance.py)
still covers them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqstore.errors import ConflictError, RemoteError, TqstoreError

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

STALE = 300.0  # seconds after its last rewrite that a lock is taken for a killed process's
REFRESH = 60.0  # seconds between a holder's rewrites of its lock
PUSH_WAIT = 120.0  # seconds a push waits for a live gc lock to go before it gives up
GC_WAIT = 10.0  # seconds a gc that found live push locks waits before it lists them once more
POLL = 1.0  # seconds between a waiting push's LISTs of the locks


@dataclass(frozen=True)
class Lock:
    """A lock object as listed: its name, kind ("push" or "gc") and Last-Modified."""

    name: str
    kind: str
    modified: float


class LockHolder:
    """One lock this process wrote; rewritten every REFRESH seconds until `release`."""

    def __init__(self, s3: S3Tier, kind: str) -> None:
        self.s3, self.kind = s3, kind
        self.name = f"{kind}-{os.urandom(12).hex()}"
        self._written = 0.0  # time.time() of the last successful write (wall clock: counts a sleep)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.taken = float("inf")  # time.monotonic() once the lock is held (no gc lock listed beside it)
        self.write()

    def write(self) -> None:
        body = json.dumps({"kind": self.kind, "time": time.time(), "machine": _machine(), "pid": os.getpid()}).encode()
        started = time.time()
        self.s3.put_lock(self.name, body)
        self._written = started

    def start(self) -> None:
        """Rewrite the lock every REFRESH seconds from a thread until `release`."""
        def run() -> None:
            while not self._stop.wait(REFRESH):
                with suppress(TqstoreError):  # `check` fails the holder if rewrites keep failing
                    self.write()

        self._thread = threading.Thread(target=run, name=f"tqstore-{self.kind}-lock", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """RemoteError when the lock may have been taken for stale (not rewritten for close to
        STALE seconds): what this holder decided may no longer hold."""
        if time.time() - self._written > STALE - REFRESH / 2:
            where = f"s3://{self.s3.bucket}/{self.s3.lock_name(self.name)}"
            raise RemoteError(f"this {self.kind}'s lock in the bucket ({where}) could not be rewritten for "
                              f"{time.time() - self._written:.0f} s, so another machine may have taken it for a "
                              "killed process's: nothing more was written; run it again")

    def _dead(self, lock: Lock) -> bool:
        """Whether `lock` was written by a process of this machine that no longer runs (killed)."""
        try:
            body = json.loads(self.s3.get_lock(lock.name))
            pid = body["pid"]
            if body["machine"] != _machine() or not isinstance(pid, int) or pid == os.getpid():
                return False
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except (TqstoreError, OSError, ValueError, KeyError, TypeError):
            return False  # unreadable, gone, or alive under another user: its age decides
        return False

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with suppress(TqstoreError):  # left behind, it goes stale
            self.s3.delete_lock(self.name)

    def others(self) -> list[Lock]:
        """The other live locks of the prefix; stale ones are deleted on the way."""
        locks = [Lock(name, name.partition("-")[0], modified) for name, modified in self.s3.list_locks().items()
                 if name.partition("-")[0] in ("push", "gc")]
        mine = next((lock.modified for lock in locks if lock.name == self.name), None)
        now = max((lock.modified for lock in locks), default=0.0) if mine is None else mine
        stale = [lock for lock in locks
                 if lock.name != self.name and (now - lock.modified >= STALE or self._dead(lock))]
        for lock in stale:
            with suppress(TqstoreError):
                self.s3.delete_lock(lock.name)
        return [lock for lock in locks if lock.name != self.name and lock not in stale]


@contextmanager
def push_lock(s3: S3Tier) -> Iterator[LockHolder]:
    """Hold a shared push lock: taken once no live gc lock is there (waiting up to PUSH_WAIT
    seconds: ConflictError then), rewritten while held, deleted at the end."""
    deadline = time.monotonic() + PUSH_WAIT
    while True:
        holder = LockHolder(s3, "push")
        try:
            gcs = [lock for lock in holder.others() if lock.kind == "gc"]
        except BaseException:
            holder.release()
            raise
        if not gcs:
            holder.taken = time.monotonic()  # what is read from now on no gc deletes until release
            break
        holder.release()
        if time.monotonic() >= deadline:
            raise ConflictError(f"a gc --remote holds s3://{s3.bucket}/{s3.lock_name(gcs[0].name)} (another machine "
                                f"collecting the bucket) after {PUSH_WAIT:.0f} s of waiting: push again when it ends (the lock of a "
                                f"killed gc is ignored {STALE / 60:.0f} minutes after its last rewrite)")
        time.sleep(POLL)
    holder.start()
    try:
        yield holder
    finally:
        holder.release()


@contextmanager
def gc_lock(s3: S3Tier) -> Iterator[tuple[LockHolder, int]]:
    """Hold a gc lock: yields it with the number of live push locks still there after one wait
    of GC_WAIT seconds (0: no push is deciding or referencing anything, objects may go; new
    pushes wait for this lock to be deleted)."""
    holder = LockHolder(s3, "gc")
    try:
        pushes = sum(lock.kind == "push" for lock in holder.others())
        if pushes:
            time.sleep(GC_WAIT)
            pushes = sum(lock.kind == "push" for lock in holder.others())
        holder.start()
        yield holder, pushes
    finally:
        holder.release()


@functools.cache
def _machine() -> str:
    """This machine, as its locks name it: a digest of the host name and the kernel's boot id
    (where there is one), so that a lock of a killed process here is known dead at once."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{boot}".encode()).hexdigest()[:16]
