"""Answering from a model job on the event loop: the worker's thread hands each event of a job
to the loop (`JobEvents.sink`, through the server's `Mailbox`), and the handler awaits them while
it watches the client's connection, so a client that goes away cancels its job at once,
whether it waits for a whole response or reads a stream. `sse` writes events as server-sent
events.

The loop and the worker share one interpreter lock, so what the loop does per token is taken
from the worker's decode steps: the mailbox wakes the loop once for every event handed over
before it runs (a decode step's token of each of 8 streams), and a stream that fell behind
sends the texts waiting for it as one event.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from typing import Any

from starlette.types import Receive

from tqstore.serve.jobs import Failed, Finished, Job, Text


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


_GONE = object()  # queued when the client has disconnected


class Mailbox:
    """Events handed from the worker's thread to the event loop, for every job: the first event
    after the loop last emptied it schedules one delivery, and the events that arrive before the
    loop runs it go with it. A wakeup per event made the loop take the interpreter lock from the
    worker once for each token of each stream."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._items: deque[tuple[JobEvents, Any]] = deque()
        self._scheduled = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop deliveries run on (the server's one loop; set by the first job)."""
        self._loop = loop

    def post(self, events: JobEvents, event: Any) -> None:
        """The worker's side: queue `event` for `events`, waking the loop unless a delivery is due."""
        with self._lock:
            self._items.append((events, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody waits for these jobs any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, deque(), False
        for events, event in items:
            events.put(event)


class JobEvents:
    """One job's events on the event loop, read on behalf of the client whose `receive` (the
    ASGI channel, its body already read) says when it disconnects. Without `texts` (a whole
    response, not a stream) Text events are dropped on the worker's side: the Finished event
    carries the whole text, and the loop is not woken for every token."""

    def __init__(self, receive: Receive, mailbox: Mailbox, texts: bool = False):
        mailbox.bind(asyncio.get_running_loop())
        self._mailbox = mailbox
        self._events: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None
        self._holding = False  # the waiter waits for the end of a text's hold, or the job's end
        self._receive = receive
        self._gone: asyncio.Future | None = None
        self._ended = False
        self._texts = texts
        self.job: Job | None = None

    def sink(self, event: Any) -> None:
        """The worker's side (its own thread): queue `event` for the loop."""
        if isinstance(event, Text) and not self._texts:
            return
        self._mailbox.post(self, event)

    def put(self, event: Any) -> None:
        """The loop's side: `event` is this job's next one (a text held back wakes nobody)."""
        self._events.append(event)
        if self._waiter is not None and not (self._holding and isinstance(event, Text)):
            _wake(self._waiter)

    async def next_event(self, hold_until: float | None = None) -> Any:
        """The job's next event, the texts waiting for it joined into one Text; cancels the job
        and raises ClientGone if the client leaves. With `hold_until` (a loop time), a text
        waits until then for the texts after it, or until the job ends."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._disconnected())
        while not self._events:
            await self._wait()
        if (hold_until is not None and isinstance(self._events[-1], Text)
                and asyncio.get_running_loop().time() < hold_until):
            self._holding = True
            try:
                await self._wait(hold_until)
            finally:
                self._holding = False
        event = self._events.popleft()
        if event is _GONE:
            self.close()
            raise ClientGone()
        if isinstance(event, Text) and self._events and isinstance(self._events[0], Text):
            parts = [event.text]
            while self._events and isinstance(self._events[0], Text):
                parts.append(self._events.popleft().text)
            event = Text("".join(parts))
        self._ended = isinstance(event, (Finished, Failed))
        return event

    async def _wait(self, until: float | None = None) -> None:
        """Until the next event is put, or the loop time `until`."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if until is None else loop.call_at(until, _wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def result(self) -> Any:
        """The job's result; its error (an ApiError) is raised."""
        try:
            while True:
                event = await self.next_event()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    return event.value
        finally:
            self.close()

    def close(self) -> None:
        """Stop watching; a job that has not ended is cancelled (its client is not reading)."""
        if not self._ended and self.job is not None:
            self.job.cancel()
        self._ended = True
        if self._gone is not None:
            self._gone.cancel()

    async def _disconnected(self) -> None:
        """Puts _GONE when the client disconnects: one line of events to wait on, token after token."""
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.put(_GONE)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TextPacer:
    """When a stream's next text may go out: at most one text event per `interval` seconds
    after the first, which goes at once. What a stream's writes cost the loop (a JSON event, the
    HTTP framing, a system call) is then paid per interval, not per token, while decode steps
    of many streams follow each other faster than a client needs its text."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._sent: float | None = None

    def hold_until(self) -> float | None:
        """The loop time the next text waits for (None: it goes as soon as it comes)."""
        return None if self._sent is None or not self.interval else self._sent + self.interval

    def sent(self) -> None:
        """A text event was just written."""
        self._sent = asyncio.get_running_loop().time()


def sse(obj: Any) -> bytes:
    """One `data: {json}` server-sent event."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"  # how OpenAI ends a stream

