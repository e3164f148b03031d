"""Saves that the caller does not wait for: one writer thread stores prefixes in order.

`tqstore serve` hands each response's prefix here once its arrays are evaluated, and takes the
next request at once: serializing, hashing and the LMDB commit happen on this thread. A
request whose prompt extends a prefix still being written waits for that write only (`wait_for`),
so it finds the prefix stored. A crash loses at most the prefixes not yet written: `put` writes
an entry's manifest after its objects, so a published entry is never partial.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait


class BackgroundWriter:
    """One thread running save jobs in submission order; pending ones are known by their tokens."""

    def __init__(self, name: str = "tqstore-saver") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._pending: dict[int, tuple[tuple[int, ...], Future]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tokens: Sequence[int], job: Callable[[], object]) -> Future:
        """Queue `job` (which stores the prefix `tokens`); its Future holds its result or error."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the background writer is closed")
            self._pending[id(future)] = (tuple(tokens), future)
        future.add_done_callback(self._forget)
        self._jobs.put((job, future))
        return future

    def wait_for(self, prompt: Sequence[int], timeout: float | None = None) -> bool:
        """Wait for the pending saves whose prefix `prompt` starts with (a lookup would find
        them); True if none is left pending."""
        prompt = tuple(prompt)
        with self._lock:
            needed = [f for tokens, f in self._pending.values() if prompt[:len(tokens)] == tokens]
        return not wait(needed, timeout).not_done

    def pending(self) -> int:
        """How many saves are queued or running."""
        with self._lock:
            return len(self._pending)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued saves (up to `timeout` seconds) and end the thread; False if some
        were still running or queued when the timeout passed (they are then lost)."""
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.pop(id(future), None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                future.set_result(job())
            except BaseException as exc:  # the caller's callback reports it; the thread goes on
                future.set_exception(exc)
