"""Answering from a model job on the event loop: the worker's thread hands each event of a job
to the loop (`JobEvents.sink`, through call_soon_threadsafe), and the handler awaits them while
it watches the client's connection, so a client that goes away cancels its job at once,
whether it waits for a whole response or reads a stream. `sse` writes events as server-sent
events.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Receive

from tqstore.serve.jobs import Failed, Finished, Job, Text


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


_GONE = object()  # queued when the client has disconnected


class JobEvents:
    """One job's events on the event loop, read on behalf of the client whose `receive` (the
    ASGI channel, its body already read) says when it disconnects. Without `texts` (a whole
    response, not a stream) Text events are dropped on the worker's side: the Finished event
    carries the whole text, and the loop is not woken for every token."""

    def __init__(self, receive: Receive, texts: bool = False):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._receive = receive
        self._gone: asyncio.Future | None = None
        self._ended = False
        self._texts = texts
        self.job: Job | None = None

    def sink(self, event: Any) -> None:
        """The worker's side (its own thread): queue `event` for the loop."""
        if isinstance(event, Text) and not self._texts:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody waits for this job any more
            pass

    async def next_event(self) -> Any:
        """The job's next event; cancels the job and raises ClientGone if the client leaves."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._disconnected())
        event = await self._queue.get()
        if event is _GONE:
            self.close()
            raise ClientGone()
        self._ended = isinstance(event, (Finished, Failed))
        return event

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
        """Queues _GONE when the client disconnects: one queue to wait on, token after token."""
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._queue.put_nowait(_GONE)


def sse(obj: Any) -> bytes:
    """One `data: {json}` server-sent event."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"  # how OpenAI ends a stream

