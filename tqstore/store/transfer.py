"""Moving entries between the LMDB store and the bucket: push and pull.

Push uploads an entry's objects create-only (a HEAD first, so an object the bucket holds is
never sent again: a push that failed half-way resumes where it stopped), then writes the
manifest last with a conditional write: created with If-None-Match, or replaced with If-Match
when the bucket still holds the version this entry was last pushed as or pulled from. Any
other manifest under that name is a ConflictError, unless it describes the same entry.

Pull publishes the bucket's entry locally by the path put and import take (publish.py): the
objects LMDB lacks are downloaded and verified completely (digest from the bucket's manifest,
then format, identity, tokens and keys), written, then the manifest.

Block 0's key does not cover its calibration (see put.py): when the destination already holds a
block 0 (or window) of another save under the same key, the transfer stops with ConflictError
before any manifest is written, since the entry's later blocks would not fit that copy.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqstore.errors import ConflictError, CorruptBlock, FormatError, NotFound
from tqstore.format.manifest import Manifest, ObjectRef
from tqstore.store.crypto import UnboundManifest
from tqstore.store.publish import Batch, publish
from tqstore.store.tierset import TierSet, check_name
from tqstore.store.verify import BAD_CONTENT, Want, decode, wants_for

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

Progress = Callable[[int, int, int], None]  # (objects done, objects in all, bytes transferred)
PENDING = "pending:"  # a remote_etag recorded before a manifest write whose etag is not known yet


@dataclass(frozen=True)
class TransferStats:
    """What a push or pull moved."""

    entries: tuple[str, ...]
    objects: int  # objects of those entries
    transferred: int  # uploaded or downloaded
    skipped: int  # already at the destination
    bytes: int  # bytes uploaded or downloaded
    seconds: float
    up_to_date: tuple[str, ...] = ()  # pushed entries the bucket already held identically
    evicted: tuple[str, ...] = ()  # entries the LMDB budget evicted after a pull
    warnings: tuple[str, ...] = ()


class _Tally:
    """Counts of one transfer, reported to `progress` on the calling thread."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.progress = total, progress
        self.done = self.transferred = self.skipped = self.bytes = 0
        self._keys: set[bytes] = set()

    def count(self, moved: int | None) -> None:
        """One object done: `moved` bytes transferred, or None when it was already there."""
        self.done += 1
        if moved is None:
            self.skipped += 1
        else:
            self.transferred += 1
            self.bytes += moved
        if self.progress is not None:
            self.progress(self.done, self.total, self.bytes)

    def count_once(self, key: bytes, moved: int | None) -> None:
        """`count` for object `key` unless it was counted already (a publish that plans again
        meets the objects it has just written)."""
        if key not in self._keys:
            self._keys.add(key)
            self.count(moved)


def push(tiers: TierSet, name: str | None, progress: Progress | None) -> TransferStats:
    """Upload entry `name` (every local entry when None) to the bucket; see the module docstring."""
    s3 = tiers.require_s3()
    start = time.perf_counter()
    if name is not None:
        manifests = [tiers.require_manifest(name)]
    else:
        entries, _ = tiers.local_manifests()  # unreadable ones are left out; `tqstore verify` names them
        manifests = sorted((m for m, _ in entries if not m.expired(time.time())), key=lambda m: m.name)
    tally = _Tally(sum(len(m.objects) for m in manifests), progress)
    up_to_date = []
    for manifest in manifests:
        digests = _upload(tiers, s3, manifest, tally)
        remote = manifest.with_digests(digests).replace(pinned=False, remote_etag=None)
        manifest = _intend(tiers, manifest, remote)
        etag, written = _publish_manifest(s3, manifest, remote)
        if not written:
            up_to_date.append(manifest.name)
        if tiers.lmdb.get_manifest(manifest.name) == manifest.to_bytes():  # unless replaced meanwhile
            tiers.lmdb.put_manifest(manifest.name, manifest.replace(remote_etag=etag).to_bytes())
        tiers.remote.note_objects(digests)
        tiers.remote.note_manifest(remote, etag)
    return TransferStats(tuple(m.name for m in manifests), tally.total, tally.transferred, tally.skipped, tally.bytes,
                         time.perf_counter() - start, tuple(up_to_date))


def _upload(tiers: TierSet, s3: S3Tier, manifest: Manifest, tally: _Tally) -> dict[bytes, tuple[str, int]]:
    """Upload what the bucket lacks; returns {key: (sha256, size) of the bucket's copy}.

    Block 0 and the window go first and alone: if the bucket holds them from another save, the
    push stops before uploading later blocks that no manifest could use.
    """
    wants = {w.key: w for w in wants_for(manifest, len(manifest.blocks), remote=False)}
    unbound = {manifest.window.key, *(r.key for r in manifest.blocks[:1])}  # keys that do not hash calibration
    first = [r for r in manifest.objects if r.key in unbound]
    rest = [r for r in manifest.objects if r.key not in unbound]
    digests: dict[bytes, tuple[str, int]] = {}

    def one(ref: ObjectRef) -> tuple[str, int, int | None]:
        info = s3.object_info(ref.key)
        if info is None:
            try:
                found = tiers.lmdb.get_verified(ref.key)  # hashed once here, the digest reused for the upload
            except CorruptBlock as exc:
                raise CorruptBlock(f"entry {manifest.name} cannot be pushed: {exc}; save it again") from None
            if found is None:
                raise NotFound(f"entry {manifest.name} cannot be pushed: its {wants[ref.key].kind} "
                               f"{ref.key.hex()[:12]} is missing from the local store (tqstore verify); save it again")
            payload, sha256 = found
            if s3.put_object(ref.key, payload, sha256):
                return sha256, len(payload), len(payload)
            info = s3.object_info(ref.key)  # another machine uploaded it in between
            if info is None:
                raise ConflictError(f"entry {manifest.name} cannot be pushed: its {wants[ref.key].kind} "
                                    f"{ref.key.hex()[:12]} was deleted from the bucket while it was pushed (a remote "
                                    "gc?): push again")
        return info.sha256, info.size, None

    def done(ref: ObjectRef, result: tuple[str, int, int | None]) -> None:
        digests[ref.key] = result[:2]
        tally.count(result[2])

    for ref in first:
        s3.each(one, [ref], done)
        if digests[ref.key][0] != ref.sha256:
            _check_bucket_copy(s3, manifest, wants[ref.key], digests[ref.key][0])
    s3.each(one, rest, done)  # the first error stops it; uploads already finished stay (a retried push skips them)
    return digests


def _check_bucket_copy(s3: S3Tier, manifest: Manifest, want: Want, sha256: str) -> None:
    """The bucket holds other bytes under a key that does not bind calibration: same save, or
    ConflictError."""
    payload = s3.get_object(want.key, sha256)
    if payload is None:
        return  # deleted meanwhile; the manifest still records what was found
    try:
        decode(payload, want)
    except ConflictError as exc:
        raise ConflictError(f"entry {manifest.name} cannot be pushed: the bucket already holds its first tokens from "
                            f"another save ({exc}); pull the bucket's entry with that prefix and continue from it, "
                            "or remove it from the bucket (tqstore rm --remote, gc --remote)") from None
    except BAD_CONTENT as exc:
        raise CorruptBlock(f"the bucket's copy of {want.kind} {want.key.hex()[:12]} is damaged ({exc}): delete it from "
                           "the bucket (tqstore gc --remote after rm --remote of the entries using it) and push again"
                           ) from None


def _intend(tiers: TierSet, local: Manifest, remote: Manifest) -> Manifest:
    """Record, before the bucket's manifest is written, which version this push writes and which
    it replaces (`remote_etag` = PENDING + old etag + ":" + sha256 of the new manifest): a push
    cut off after the write, before it recorded the new etag, then still recognises the bucket's
    version as its own. Returns the local manifest as recorded (unless replaced meanwhile)."""
    pending = local.replace(remote_etag=f"{PENDING}{local.remote_etag or ''}:"
                                        f"{hashlib.sha256(remote.to_bytes()).hexdigest()}")
    if tiers.lmdb.get_manifest(local.name) != local.to_bytes():
        return local
    tiers.lmdb.put_manifest(local.name, pending.to_bytes())
    return pending


def _ours(recorded: str | None, etag: str, data: bytes) -> bool:
    """Whether the bucket's manifest (its etag and bytes) is the version this entry was last
    pushed as or pulled from, or the one a push cut off before recording its etag wrote."""
    if recorded is None:
        return False
    if not recorded.startswith(PENDING):
        return recorded == etag
    replaced, _, written = recorded[len(PENDING):].rpartition(":")
    return hashlib.sha256(data).hexdigest() == written or _ours(replaced or None, etag, data)  # replaced: maybe pending


def _write(s3: S3Tier, name: str, data: bytes, etag: str | None) -> str:
    """The conditional manifest write; a 412 caused by this very write (its answer was lost and
    the request sent again) is its success, not a conflict."""
    try:
        return s3.put_manifest(name, data, etag)
    except ConflictError:
        got = s3.get_manifest(name)
        if got is not None and got[0] == data:
            return got[1]
        raise


def _publish_manifest(s3: S3Tier, local: Manifest, remote: Manifest) -> tuple[str, bool]:
    """Write the bucket's manifest; returns (its etag, whether it was written)."""
    try:
        got = s3.get_manifest(local.name)
    except UnboundManifest as exc:
        if exc.etag is None or not _ours(local.remote_etag, exc.etag, b""):
            raise
        # Our own push or pull, sealed by an older tqstore without its address: replace it.
        return _write(s3, local.name, remote.to_bytes(), exc.etag), True
    if got is None:
        return _write(s3, local.name, remote.to_bytes(), None), True
    data, etag = got
    try:
        existing = Manifest.from_bytes(data)
    except FormatError:
        existing = None
    if existing is not None and existing.same_content(remote):
        return etag, False
    if _ours(local.remote_etag, etag, data):  # the bucket still holds our ancestor
        return _write(s3, local.name, remote.to_bytes(), etag), True
    raise ConflictError(f"the bucket already holds a different entry {local.name} (pushed from another machine or "
                        f"another save): pull it (it replaces the local entry), or push under another name")


def pull(tiers: TierSet, name: str, progress: Progress | None) -> TransferStats:
    """Download entry `name` from the bucket into LMDB; see the module docstring. The local entry of
    that name, if any, is replaced (its pin is kept)."""
    s3 = tiers.require_s3()
    start = time.perf_counter()
    got = s3.get_manifest(name)
    if got is None:
        raise NotFound(f"no entry {name} in s3://{s3.bucket}/{s3.prefix}: `tqstore ls --remote` lists the entries")
    remote = check_name(Manifest.from_bytes(got[0]), name)
    wants = wants_for(remote, len(remote.blocks), remote=True)
    tally = _Tally(len(wants), progress)
    published = publish(tiers, name, wants, _Bucket(s3),
                        lambda digests, old: remote.with_digests(digests).replace(
                            remote_etag=got[1], pinned=old is not None and old.pinned),
                        tally.count_once)
    tiers.remote.note_manifest(remote, got[1])
    return TransferStats((name,), tally.total, tally.transferred, tally.skipped, tally.bytes,
                         time.perf_counter() - start, evicted=published.evicted, warnings=published.warnings)


class _Bucket:
    """The bucket's objects as a publish source: fetched a few at a time (bounded memory), each
    verified against the bucket manifest's digest, then in full."""

    action = "pull"
    advice = "remove those entries (tqstore rm) and pull again"

    def __init__(self, s3: S3Tier) -> None:
        self.s3 = s3

    def expected(self, want: Want) -> str | None:
        """The digest the bucket's manifest records."""
        return want.sha256

    def payloads(self, missing: list[Want], kept: object) -> Iterator[Batch]:
        """Download, verify and yield `missing` in batches of 2 x concurrency objects, as a
        stream: up to `concurrency` GETs run at once, each object is verified as it arrives,
        and the downloads go on while the caller writes a batch (at most two batches are held
        beyond the one being written). Verification runs on one thread, in order: it decodes,
        and the first problem in `missing`'s order is raised."""
        step = 2 * self.s3.concurrency
        with ThreadPoolExecutor(max_workers=self.s3.concurrency, thread_name_prefix="tqstore-pull") as fetch, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="tqstore-pull-verify") as check:
            pending: deque[Future[tuple[bytes, str]]] = deque()
            try:
                queued, batch = 0, {}
                for done in range(len(missing)):
                    for want in missing[queued:done + 2 * step]:
                        pending.append(check.submit(self._verify, want, fetch.submit(self._get, want)))
                    queued = max(queued, min(len(missing), done + 2 * step))
                    batch[missing[done].key] = pending.popleft().result()
                    if len(batch) == step or done == len(missing) - 1:
                        yield batch
                        batch = {}
            finally:  # an error, or the caller stopped: nothing more starts
                for future in pending:
                    future.cancel()
                fetch.shutdown(cancel_futures=True)

    def _get(self, want: Want) -> bytes | None:
        """The bucket's payload of `want`, checked against its manifest digest, or None."""
        return self.s3.get_object(want.key, want.sha256)

    def _verify(self, want: Want, fetching: Future[bytes | None]) -> tuple[bytes, str]:
        """`want`'s payload once downloaded, verified in full, with its digest."""
        payload = fetching.result()
        what = f"{want.kind} {want.key.hex()[:12]}"
        if payload is None:
            raise NotFound(f"the bucket lacks {what}, which its manifest lists: push the entry again from a "
                           "machine that has it")
        try:
            decode(payload, want, want.sha256)  # the S3 tier just verified the bytes against it
        except ConflictError as exc:
            raise ConflictError(f"the bucket's {what} belongs to another save ({exc}): push the entry again"
                                ) from None
        except BAD_CONTENT as exc:
            raise CorruptBlock(f"the bucket's {what} is damaged ({exc}): push the entry again from a machine "
                               "that has it") from None
        return payload, want.sha256
