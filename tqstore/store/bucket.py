"""Reading many objects from the bucket wherever they lie (packs or loose), as a pipeline.

Neighbouring members of one pack are fetched by one ranged GET of up to a part (packs.py
`plan_spans`), up to `concurrency` GETs at once, a bounded number of spans ahead of the object
being consumed. A GET's body is read as a stream: each member is opened (an envelope), checked
against its manifest digest and handed to `check` (the full verification) on a pool of verifier
threads as soon as its last byte has arrived, so verification (and the caller's writes of what
is verified) overlap the rest of the download. Results come back one per object, in the order
asked or (`ordered=False`, for a pull, whose writes need no order) as each is checked, so that
what arrives first is written first while packs download side by side: the value of `check`,
None when the bucket lacks the object, or the TqstoreError it ended in (one damaged object hides
none of the others).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from tqstore.errors import CorruptBlock, TqstoreError
from tqstore.store.packs import Location, Span, plan_spans
from tqstore.store.object_checks import Want

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

T = TypeVar("T")
VERIFIERS = max(2, min(4, os.cpu_count() or 1))  # threads verifying objects while others download


def fetch_objects(s3: S3Tier, located: Sequence[tuple[Want, Location]], check: Callable[[Want, bytes], T],
                  ordered: bool = True) -> Iterator[tuple[Want, T | TqstoreError | None]]:
    """(want, check(want, payload) | None | error) for each of `located`, in order (or as each
    is checked: `ordered=False`); see the module docstring. Each want must carry the sha256 its
    payload must have."""
    where = {w.key: (w, loc) for w, loc in located}
    # Spans of up to a part: a pack (a push's packs are about a part each) comes in one GET.
    spans = plan_spans([(w.key, loc) for w, loc in located], s3.part_size)
    ahead = 2 * s3.concurrency
    stop = threading.Event()

    def one(want: Want, loc: Location, body: bytes | None) -> T | TqstoreError | None:
        if body is None:
            return None
        try:
            payload = body if loc.pack is None else s3.open_member(loc.pack, loc.offset, body, want.key, want.sha256)
            return check(want, payload)
        except TqstoreError as exc:
            return exc

    def get(span: Span, results: list[Future]) -> None:
        """Download `span`, handing each object to the verifiers as it arrives; every one of
        `results` is settled, whatever happens."""
        done = 0

        def arrived(body: bytes | None) -> None:
            nonlocal done
            want, loc = where[span.keys[done]]
            _chain(checks.submit(one, want, loc, body), results[done])
            done += 1

        try:
            if span.pack is None:
                want = where[span.keys[0]][0]
                arrived(s3.get_object(want.key, want.sha256))
                return
            cuts = [where[k][1].offset + where[k][1].length for k in span.keys]
            for body in s3.read_range(span.pack, span.start, cuts):
                if body is None:  # the pack is gone: so is every member
                    while done < len(results):
                        arrived(None)
                    return
                if stop.is_set():
                    break
                arrived(body)
        except CorruptBlock as exc:  # a damaged span: named for each object it held
            for k, result in zip(span.keys[done:], results[done:]):
                want = where[k][0]
                _settle(result, CorruptBlock(f"{want.kind} {want.key.hex()}: {exc}"))
            done = len(results)
        except TqstoreError as exc:
            for result in results[done:]:
                _settle(result, exc)
            done = len(results)
        except BaseException as exc:  # a bug: raised where its result is read
            for result in results[done:]:
                if not result.done():
                    result.set_exception(exc)
            done = len(results)
        finally:
            for result in results[done:]:  # stopped early: nobody reads these
                _settle(result, None)

    with ThreadPoolExecutor(max_workers=s3.concurrency, thread_name_prefix="tqstore-get") as gets, \
            ThreadPoolExecutor(max_workers=VERIFIERS, thread_name_prefix="tqstore-check") as checks:
        pending: deque[tuple[int, Want, Future]] = deque()  # (span index, want, its result)
        settled: queue.SimpleQueue[tuple[int, Want, Future]] = queue.SimpleQueue()  # unordered: as checked
        open_spans: dict[int, int] = {}  # unordered: span index -> its results not yet yielded
        started = 0

        def start() -> None:
            nonlocal started
            results = [Future() for _ in spans[started].keys]
            for key, result in zip(spans[started].keys, results):
                item = (started, where[key][0], result)
                if ordered:
                    pending.append(item)
                else:
                    result.add_done_callback(lambda _, item=item: settled.put(item))
            if not ordered:
                open_spans[started] = len(results)
            gets.submit(get, spans[started], results)
            started += 1

        try:
            if ordered:
                while started < len(spans) or pending:
                    while started < len(spans) and started < ahead + (pending[0][0] if pending else started):
                        start()
                    _, want, result = pending.popleft()
                    yield want, result.result()
            else:  # the same bound: at most `ahead` spans not yet consumed
                while started < len(spans) or open_spans:
                    while started < len(spans) and len(open_spans) < ahead:
                        start()
                    index, want, result = settled.get()
                    open_spans[index] -= 1
                    if not open_spans[index]:
                        del open_spans[index]
                    yield want, result.result()
        finally:  # an error, or the caller stopped: nothing more starts, downloads end early
            stop.set()
            gets.shutdown(cancel_futures=True)


def _settle(result: Future, value: object) -> None:
    if not result.done():
        result.set_result(value)


def _chain(source: Future, target: Future) -> None:
    """`target` takes `source`'s outcome when it is known."""
    def copy(done: Future) -> None:
        if target.done():
            return
        if done.cancelled():
            target.set_result(None)
        elif done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
