"""Two small concurrency pieces of the LMDB tier: the single writer thread and the resize gate."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class WriterThread:
    """Runs every write job of one LMDB environment on one OS thread, in submission order.

    LMDB write transactions belong to the thread that began them and writers are serialised by
    LMDB's mutex anyway, so one thread (as py-lmdb's `aio` does) keeps that mutex uncontended
    inside the process. Callers block until their job ran and get its result or its exception.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The OS thread the jobs run on."""
        return self._thread

    def run(self, job: Callable[[], T]) -> T:
        """Run `job()` on the writer thread and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            return job()  # a job that calls back into the tier must not wait on itself
        return self.submit(job).result()

    def submit(self, job: Callable[[], T]) -> Future:
        """Queue `job()` behind the jobs already queued; its Future holds the result."""
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # handed to the caller, who re-raises it
                    future.set_exception(exc)


class ResizeGate:
    """A readers-writer lock around LMDB transactions.

    `Environment.set_mapsize` (growing the map, adopting another process's size) and replacing
    the environment (compaction) invalidate every open transaction of the process, so they take
    the gate exclusively while ordinary read and write transactions take it shared. A waiting
    exclusive holder blocks new shared holders, so a stream of readers cannot starve a resize.
    Rule: never wait on the writer thread while holding the gate shared.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
