"""Reading many objects from the bucket wherever they lie (packs or loose), as a pipeline.

Neighbouring members of one pack are fetched by one ranged GET of up to a part (packs.py
`plan_spans`), up to `concurrency` GETs at once, a bounded number of spans ahead of the object
being consumed; each object is opened (an envelope), checked against its manifest digest and
handed to `check` (the full verification) on a pool of verifier threads, so verification
overlaps the downloads. Results come back in the order asked, one per object: the value of
`check`, None when the bucket lacks the object, or the TqstoreError it ended in (one damaged
object hides none of the others).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from tqstore.errors import CorruptBlock, TqstoreError
from tqstore.store.packs import Location, Span, plan_spans
from tqstore.store.verify import Want

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

T = TypeVar("T")
VERIFIERS = max(2, min(4, os.cpu_count() or 1))  # threads verifying objects while others download


def fetch_objects(s3: S3Tier, located: Sequence[tuple[Want, Location]],
          check: Callable[[Want, bytes], T]) -> Iterator[tuple[Want, T | TqstoreError | None]]:
    """(want, check(want, payload) | None | error) for each of `located`, in order; see the
    module docstring. Each want must carry the sha256 its payload must have."""
    where = {w.key: (w, loc) for w, loc in located}
    # Spans of up to a part: a pack (a push's packs are about a part each) comes in one GET.
    spans = plan_spans([(w.key, loc) for w, loc in located], s3.part_size)
    ahead = 2 * s3.concurrency

    def get(span: Span) -> dict[bytes, bytes | None]:
        if span.pack is None:
            want = where[span.keys[0]][0]
            return {want.key: s3.get_object(want.key, want.sha256)}
        body = s3.get_range(span.pack, span.start, span.end)
        if body is None:
            return dict.fromkeys(span.keys)
        view = memoryview(body)
        return {k: view[where[k][1].offset - span.start:where[k][1].offset - span.start + where[k][1].length]
                for k in span.keys}

    def one(want: Want, loc: Location, got: Future[dict[bytes, bytes | None]]) -> T | TqstoreError | None:
        try:
            try:
                body = got.result()[want.key]
            except CorruptBlock as exc:  # a damaged span: named for each object it held
                return CorruptBlock(f"{want.kind} {want.key.hex()}: {exc}")
            if body is None:
                return None
            payload = body if loc.pack is None else s3.open_member(loc.pack, loc.offset, bytes(body), want.key,
                                                                   want.sha256)
            return check(want, payload)
        except TqstoreError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=s3.concurrency, thread_name_prefix="tqstore-get") as gets, \
            ThreadPoolExecutor(max_workers=VERIFIERS, thread_name_prefix="tqstore-check") as checks:
        pending: deque[tuple[int, Want, Future]] = deque()  # (span index, want, its result)
        started = 0
        try:
            while started < len(spans) or pending:
                while started < len(spans) and started < ahead + (pending[0][0] if pending else started):
                    got = gets.submit(get, spans[started])
                    for key in spans[started].keys:
                        want, loc = where[key]
                        pending.append((started, want, checks.submit(one, want, loc, got)))
                    started += 1
                _, want, result = pending.popleft()
                yield want, result.result()
        finally:  # an error, or the caller stopped: nothing more starts
            for _, _, future in pending:
                future.cancel()
            gets.shutdown(cancel_futures=True)
