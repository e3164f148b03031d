"""The turns of `tqstore serve`'s model thread: a bounded queue of jobs, up to `max_running` of
them running, each cycle their own steps then one batched decode step, and parking a job that has
held its place for HOLD_SECONDS while others wait (worker.py describes the whole).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any

from tqstore.engine.batch import DecodeBatch, Row
from tqstore.engine.prefill import PrefillRow
from tqstore.engine.shared_prefill import prefill_rows
from tqstore.errors import TqstoreError
from tqstore.serve.chunking import CHUNK_SECONDS
from tqstore.serve.jobs import Failed, Job, QueueFull, Running, shutting_down
from tqstore.serve.metrics import Metrics, QueueState
from tqstore.serve.openai_schema import ApiError, api_error

log = logging.getLogger("tqstore.serve")
HOLD_SECONDS = 1.0  # model time a job runs for, once admitted, before it yields its place to a waiting one


class Scheduler:
    """The waiting line (at most `capacity` jobs, new or parked) and the running jobs, whose steps
    the model thread runs in turns (`run`); other threads only `submit` and `stop`."""

    def __init__(self, capacity: int, max_running: int, metrics: Metrics):
        self.capacity = capacity
        self.max_running = max_running
        self.metrics = metrics
        self.step_seconds = 0.0  # the last decode step's
        self._batch = DecodeBatch()  # the running rows' shared decode state (model thread only)
        # What waits for a place among the running: new jobs, and parked ones (started, their
        # state kept), in the order they began to wait; at most `capacity` of them.
        self._waiting: deque[Job | Running] = deque()
        self._arrived = threading.Condition()  # guards _waiting; notified when a job is queued
        self.stopping = threading.Event()
        self._running: deque[Running] = deque()  # only the model thread changes it
        self._job_seconds = 1.0  # moving average, for Retry-After

    def state(self, batching: bool) -> QueueState:
        """How many jobs wait and run, for /metrics and the health check."""
        return QueueState(len(self._waiting), self.capacity, len(self._running), batching)

    def submit(self, job: Job) -> Job:
        """Queue `job`; QueueFull when the line is full, 503 once the server is stopping."""
        if self.stopping.is_set():
            raise shutting_down().error
        with self._arrived:
            # Jobs the model thread has not yet moved into free running places do not wait for
            # one: requests arriving together at an idle server were refused with places free.
            waiting = len(self._waiting) - max(0, self.max_running - len(self._running))
            if waiting >= self.capacity:
                wait = self._job_seconds * (waiting + 1)
                raise QueueFull(max(1, min(60, math.ceil(wait))))
            self._waiting.append(job)
            self._arrived.notify()
        return job

    def stop(self) -> None:
        """Cancel the running jobs and fail the waiting ones; `run` returns at its next turn."""
        self.stopping.set()
        for running in list(self._running):
            running.job.cancel()
        self.drain()

    def drain(self) -> None:
        """Fail every waiting job: the server is going away."""
        with self._arrived:
            waiting, self._waiting = list(self._waiting), deque()
        for item in waiting:
            job = item.job if isinstance(item, Running) else item
            job.send(shutting_down())

    def run(self, model: Any) -> None:
        """Run the jobs' steps on this thread, decode steps through `model`, until stopped; then
        fail what still runs or waits."""
        while not self.stopping.is_set():
            self._admit(wait=not self._running)
            if self._running:
                self._cycle(model)
        for running in self._running:  # stopped mid-generation: the server is going away
            running.job.send(shutting_down())
        self._running.clear()
        self.drain()

    def _admit(self, wait: bool) -> None:
        """Start or resume waiting jobs, longest waiting first, while fewer than `max_running`
        run; waits a moment for one when `wait` (nothing runs)."""
        while len(self._running) < self.max_running:
            with self._arrived:
                if not self._waiting and wait:
                    self._arrived.wait(0.2)
                if not self._waiting:
                    return
                item = self._waiting.popleft()
            wait = False
            if isinstance(item, Running):  # parked: resumed where it stopped (a cancelled one ends at its next token)
                self._running.append(item)
            elif item.cancelled.is_set():
                self.metrics.count_cancelled()
            else:
                self._running.append(Running(item, item.work(item)))

    def _cycle(self, model: Any) -> None:
        """Steps of the running jobs that do not wait on a Row, least model time first, then one
        forward pass over the short prefills they handed out (`PrefillRow`: requests that arrive
        together start together, in one pass), then one batched decode step over every job that
        waits on a Row; then park jobs that have held their place for HOLD_SECONDS while others
        wait for one.

        The steps fit in CHUNK_SECONDS: the first job runs steps until the time is spent or it
        waits on a Row (a new request's prefill and its first Row in one cycle), each next job
        one or more steps if its last step fits in what is left. A new request's first step
        restores its stored prefix and, when the rest is short, hands it out without running it.
        Once a job reaches its Row (or PrefillRow) in a cycle, the started jobs after it wait:
        the new row decodes before a long prompt's next chunk (jobs not started yet still start,
        so requests that arrive together join together). A request that arrives while there is
        room for it ends the started jobs' own steps at the one in progress (new ones still take
        their first): it starts in the next cycle, after one chunk of a long prompt, not after
        the rest of this cycle's CHUNK_SECONDS of them."""
        others = sorted((r for r in self._running if r.pending is None), key=lambda r: r.seconds)
        left, ready, newcomer = CHUNK_SECONDS, False, False
        for i, other in enumerate(others):
            if i and (((ready or newcomer) and other.seconds) or other.job.step_seconds > left):
                continue
            while left > 0 and other.pending is None and other in self._running:
                left -= self._own_step(other)
                newcomer = self._room_for_waiting()
                if newcomer:
                    break
            ready = ready or other.pending is not None
        prefilling = [r for r in self._running if isinstance(r.pending, PrefillRow)]
        if prefilling:
            self._prefill(model, prefilling)
        decoding = [r for r in self._running if isinstance(r.pending, Row)]
        overdue = self._overdue()
        if decoding:
            parking = {id(r.pending) for r in overdue}
            try:
                served = self._batch.step(model, [r.pending for r in decoding], keep=lambda row: id(row) not in parking)
            except BaseException as e:  # the worker must outlive any one step
                self._fail(decoding, e, "a decode step")
                return
            spent = self.step_seconds = self._batch.seconds
            self.metrics.decoded(len(served), spent)
            stepped = {id(row) for row in served}
            for running in decoding:
                running.charge(spent)
                if id(running.pending) in stepped:
                    self._advance(running)
        else:
            self._batch.settle()
        for running in overdue:
            if running in self._running:
                self._running.remove(running)
                self._park(running)

    def _room_for_waiting(self) -> bool:
        """Whether a job waits and could start now (fewer than `max_running` run)."""
        return bool(self._waiting) and len(self._running) < self.max_running

    def _prefill(self, model: Any, prefilling: list[Running]) -> None:
        """Run the short prefills the jobs wait on in one forward pass, then each job on to its
        first Row (joining this cycle's decode step)."""
        try:
            spent = prefill_rows(model, [r.pending for r in prefilling])
        except BaseException as e:  # the worker must outlive any one pass
            self._fail(prefilling, e, "a shared prefill")
            return
        self.metrics.prefilled_together(len(prefilling))
        for running in prefilling:
            running.charge(spent)
            self._advance(running)

    def _fail(self, jobs: list[Running], error: BaseException, what: str) -> None:
        """`what`, a pass shared by `jobs`, raised `error` (called where it was caught): each of
        them fails with it and leaves the running ones."""
        log.exception("%s failed", what)
        for running in jobs:
            running.job.send(Failed(api_error(error)))
            self._end(running)

    def _overdue(self) -> list[Running]:
        """The running jobs to park after this cycle's decode step: those that will have held
        their place for HOLD_SECONDS (counting the step, as long as the last one) while others
        wait. Known before the step, so that it does not run ahead for them (batch.py)."""
        if not self._waiting or self.stopping.is_set():
            return []
        return [r for r in self._running if r.held + self.step_seconds >= HOLD_SECONDS][:len(self._waiting)]

    def _own_step(self, running: Running) -> float:
        """Run one step of a job that does not wait on a Row (a prefill chunk, say); its model time."""
        t0 = time.perf_counter()
        self._advance(running)
        spent = time.perf_counter() - t0
        running.job.step_seconds = spent
        running.charge(spent)
        return spent

    def _advance(self, running: Running) -> None:
        """Run a job to its next yield; a job that ends or fails leaves the running ones."""
        try:
            running.pending = next(running.steps)
            return
        except StopIteration:
            pass
        except BaseException as e:  # the worker must outlive any one job
            if not isinstance(e, (ApiError, TqstoreError)):
                log.exception("%s job failed", running.job.kind)
            running.job.send(Failed(api_error(e)))
        self._end(running)

    def _end(self, running: Running) -> None:
        if running in self._running:
            self._running.remove(running)
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * running.seconds

    def _park(self, running: Running) -> None:
        """Put a running job at the back of the waiting line, its state kept. It takes the
        place of the one admitted next, so the line never grows past `capacity`."""
        running.held = 0.0
        with self._arrived:
            self._waiting.append(running)
