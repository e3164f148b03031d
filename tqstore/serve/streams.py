"""Answering from a model job over HTTP: waiting for the job's events while watching the
client's socket, and writing events as server-sent events.

A client that goes away cancels its job, whether it is waiting for a whole response or
reading a stream: a write that fails says so, and so does a socket that turns readable with
nothing to read (a FIN or a reset), which is checked every POLL_SECONDS while nothing is
written.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import time
from typing import Any, BinaryIO

from tqstore.serve.worker import Failed, Finished, Job

POLL_SECONDS = 0.2


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client has closed (or reset) its end of the connection."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class JobWatch:
    """One job's events, read on behalf of the client connected on `sock`."""

    def __init__(self, job: Job, sock: socket.socket):
        self.job = job
        self.sock = sock
        self._checked = time.monotonic()

    def next_event(self):
        """The job's next event; cancels the job and raises ClientGone if the client leaves."""
        while True:
            try:
                event = self.job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check()
                continue
            # Events can come faster than the poll interval while nothing reaches the client
            # (text held back for a possible stop sequence): look at the socket now and then.
            if time.monotonic() - self._checked > POLL_SECONDS:
                self._check()
            return event

    def result(self) -> Any:
        """The job's result; its error (an ApiError) is raised."""
        while True:
            event = self.next_event()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                return event.value

    def gone(self) -> None:
        """The client went away (a write failed): cancel the job."""
        self.job.cancel()
        raise ClientGone()

    def _check(self) -> None:
        self._checked = time.monotonic()
        if peer_closed(self.sock):
            self.gone()


class EventStream:
    """Server-sent events on a response body: chunked (HTTP/1.1, the connection stays usable)
    or delimited by closing the connection (HTTP/1.0)."""

    def __init__(self, wfile: BinaryIO, chunked: bool):
        self.wfile = wfile
        self.chunked = chunked

    def send(self, obj: Any) -> None:
        """One `data: {json}` event."""
        self._write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def close(self) -> None:
        """`data: [DONE]`, as OpenAI ends a stream, and the end of the body."""
        self._write(b"data: [DONE]\n\n")
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data) if self.chunked else data)
