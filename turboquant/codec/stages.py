"""Work that needs the device's answers at a few decision points, written as generators.

A stage generator yields the arrays its next decision reads; the driver evaluates them and
resumes it, and its return value is the result. One piece of work runs with one evaluation per
decision (`run`); many run in lockstep with one evaluation per decision for all of them
(`run_all`), which on a GPU is one host-device round trip instead of one per layer: compressing
a request's caches made about five per layer (a fitted calibration's flatness checks, the
guard's verdict, the encoded rows), each waiting for whatever the device was running.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")
Stages = Generator[list[mx.array], None, T]


def run(stages: Stages[T]) -> T:
    """Drive one stage generator to its result."""
    return run_all([stages])[0]


def run_all(works: list[Stages[Any]]) -> list[Any]:
    """Drive stage generators in lockstep, evaluating what they all yielded at once per stage;
    their results in order."""
    results: list[Any] = [None] * len(works)
    for _ in stepping(works, results):
        pass
    return results


def stepping(works: list[Stages[Any]], results: list[Any] | None = None) -> Generator[None, None, None]:
    """`run_all` that yields None after each evaluation, so that a caller sharing the device
    (the server's scheduler) can run other work between them; the works' results go into
    `results` (one slot per work) as each ends."""
    results = [None] * len(works) if results is None else results
    waiting = _advance(works, range(len(works)), results)
    while waiting:
        mx.eval([a for arrays in waiting.values() for a in arrays])
        yield
        waiting = _advance(works, waiting, results)


def _advance(works: list[Stages[Any]], which, results: list[Any]) -> dict[int, list[mx.array]]:
    waiting = {}
    for i in which:
        try:
            waiting[i] = next(works[i])
        except StopIteration as done:
            results[i] = done.value
    return waiting
