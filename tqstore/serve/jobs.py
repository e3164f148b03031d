"""A job of `tqstore serve`'s model worker and the events it sends back: one unit of model work
(a generation, a save, a token count) and the channel to the HTTP handler that waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

from tqstore.engine.batch import Row
from tqstore.engine.prefill import PrefillRow
from tqstore.serve.openai_schema import ApiError


@dataclass(frozen=True)
class Accepted:
    """The prompt's stored prefix is restored and generation starts (a stream may send its
    headers, which say where the prompt came from)."""

    prompt_tokens: int
    cached_tokens: int = 0
    tier: str = "none"


@dataclass(frozen=True)
class Text:
    """More answer text, safe to send (stop sequences already cut)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The job's result: a Generation, or the EntryInfo of a saved cache."""

    value: Any


@dataclass(frozen=True)
class Failed:
    """The job failed; `error` is what the client gets."""

    error: ApiError


Event = Accepted | Text | Finished | Failed
Sink = Callable[[Event], None]


@dataclass
class Job:
    """One unit of model work and the channel back to the HTTP handler waiting for it."""

    kind: str  # "generate" or "save"
    work: Callable[[Job], Iterator[Row | PrefillRow | None]]  # a generator: it yields where the worker may switch jobs
    sink: Sink  # takes the job's events, on the worker's thread: it must not block
    cancelled: threading.Event = field(default_factory=threading.Event)
    step_seconds: float = 0.0  # model time of its last own step (a prefill chunk, say)

    def send(self, event: Event) -> None:
        """Hand `event` to the job's sink."""
        self.sink(event)

    def cancel(self) -> None:
        """The client went away: skip the job, or stop it at its next token."""
        self.cancelled.set()


@dataclass(eq=False)
class Running:
    """A job the worker has started: its remaining steps, the decode row or shared prefill it
    waits on (None: it waits for a step of its own) and the model time it has used."""

    job: Job
    steps: Iterator[Row | PrefillRow | None]
    pending: Row | PrefillRow | None = None
    seconds: float = 0.0
    held: float = 0.0  # model time since it was last admitted

    def charge(self, seconds: float) -> None:
        """Count `seconds` of model time spent on this job (its share of a pass counts whole)."""
        self.seconds += seconds
        self.held += seconds


class QueueFull(Exception):
    """The queue is full; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: retry after {retry_after} s")
        self.retry_after = retry_after


def shutting_down() -> Failed:
    """What a job that the stopping server will not run gets."""
    return Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutting_down"))
