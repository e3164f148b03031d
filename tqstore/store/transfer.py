"""Moving entries between the LMDB store and the bucket: push and pull.

Push uploads an entry's objects create-only (a HEAD first, so an object the bucket holds is
never sent again: a push that failed half-way resumes where it stopped), then writes the
manifest last with a conditional write: created with If-None-Match, or replaced with If-Match
when the bucket still holds the version this entry was last pushed as or pulled from. Any
other manifest under that name is a ConflictError, unless it describes the same entry.

Pull downloads the objects LMDB lacks, verifies every one completely (digest from the bucket's
manifest, then format, identity, tokens and keys), writes them, then the manifest.

Block 0's key does not cover its calibration (see put.py): when the destination already holds a
block 0 (or window) of another save under the same key, the transfer stops with ConflictError
before any manifest is written, since the entry's later blocks would not fit that copy.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from tqstore.errors import ConflictError, CorruptBlock, FormatError, NotFound, TqstoreError
from tqstore.store.verify import BAD_CONTENT, Want, decode, quarantine_lmdb, wants_for
from tqstore.store.maintenance import enforce_budget
from tqstore.format.manifest import Manifest, ObjectRef
from tqstore.store.tiers.s3 import S3Tier
from tqstore.store.tierset import TierSet, check_name

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
        etag, written = _publish(s3, manifest, remote)
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

    def one(ref: ObjectRef) -> tuple[bytes, str, int, int | None]:
        info = s3.object_info(ref.key)
        if info is None:
            try:
                payload = tiers.lmdb.get_object(ref.key)
            except CorruptBlock as exc:
                raise CorruptBlock(f"entry {manifest.name} cannot be pushed: {exc}; save it again") from None
            if payload is None:
                raise NotFound(f"entry {manifest.name} cannot be pushed: its {wants[ref.key].kind} "
                               f"{ref.key.hex()[:12]} is missing from the local store (tqstore verify); save it again")
            if s3.put_object(ref.key, payload):
                return ref.key, hashlib.sha256(payload).hexdigest(), len(payload), len(payload)
            info = s3.object_info(ref.key)  # another machine uploaded it in between
            if info is None:
                raise ConflictError(f"entry {manifest.name} cannot be pushed: its {wants[ref.key].kind} "
                                    f"{ref.key.hex()[:12]} was deleted from the bucket while it was pushed (a remote "
                                    "gc?): push again")
        return ref.key, info.sha256, info.size, None

    for ref in first:
        _run(s3.concurrency, one, [ref], digests, tally)
        if digests[ref.key][0] != ref.sha256:
            _check_bucket_copy(s3, manifest, wants[ref.key], digests[ref.key][0])
    _run(s3.concurrency, one, rest, digests, tally)
    return digests


def _run(concurrency: int, fn: Callable[[ObjectRef], tuple[bytes, str, int, int | None]], refs: list[ObjectRef],
         digests: dict[bytes, tuple[str, int]], tally: _Tally) -> None:
    """`fn` over `refs` in parallel; results counted on this thread; the first error stops it
    (uploads already finished stay: a retried push skips them)."""
    if not refs:
        return
    with ThreadPoolExecutor(max_workers=min(concurrency, len(refs))) as pool:
        futures = [pool.submit(fn, ref) for ref in refs]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
                key, sha, size, moved = future.result()
                digests[key] = (sha, size)
                tally.count(moved)


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


def _publish(s3: S3Tier, local: Manifest, remote: Manifest) -> tuple[str, bool]:
    """Write the bucket's manifest; returns (its etag, whether it was written)."""
    got = s3.get_manifest(local.name)
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
    before, _ = enforce_budget(tiers, keep=name)  # over the budget already: make room first (see put.py)
    with tiers.lock.shared():
        digests, missing = {}, []
        for want, ref in zip(wants, remote.objects):
            local = _local_copy(tiers, remote, want, ref)
            if local is None:
                missing.append(want)
            else:
                digests[want.key] = local
                tally.count(None)
        for i in range(0, len(missing), 2 * s3.concurrency):  # bounded memory: a few objects at a time
            digests.update(_download(tiers, s3, missing[i:i + 2 * s3.concurrency], tally))
        try:
            old = tiers.local_manifest(name)
        except FormatError:
            old = None
        local = remote.with_digests(digests).replace(remote_etag=got[1], pinned=old is not None and old.pinned)
        tiers.lmdb.put_manifest(name, local.to_bytes())
    tiers.remote.note_manifest(remote, got[1])
    if local.pinned:
        tiers.refresh_pins()
    evicted, warnings = enforce_budget(tiers, keep=name)
    return TransferStats((name,), tally.total, tally.transferred, tally.skipped, tally.bytes,
                         time.perf_counter() - start, evicted=tuple(before + evicted), warnings=tuple(warnings))


def _local_copy(tiers: TierSet, remote: Manifest, want: Want, ref: ObjectRef) -> tuple[str, int] | None:
    """(sha256, size) of a usable LMDB copy of `want`, or None to download it. A copy with other
    bytes is checked in full; a good copy of another save is a ConflictError."""
    info = tiers.lmdb.object_info(want.key)
    if info is None:
        return None
    if info.sha256 == ref.sha256:
        return info.sha256, info.size
    try:
        payload = tiers.lmdb.get_object(want.key)
    except CorruptBlock:
        return None  # quarantined by the tier
    if payload is None:
        return None
    try:
        decode(payload, want)
    except ConflictError as exc:
        users = [m.name for m, _ in tiers.local_manifests()[0] if want.key in {r.key for r in m.objects}]
        raise ConflictError(f"cannot pull {remote.name}: this store holds its first tokens from another save ({exc}), "
                            f"used by {', '.join(users) or 'no entry'}; remove those entries (tqstore rm) and pull "
                            "again") from None
    except BAD_CONTENT as exc:
        quarantine_lmdb(tiers.lmdb, want.key, f"{type(exc).__name__}: {exc}")
        return None
    return info.sha256, info.size


def _download(tiers: TierSet, s3: S3Tier, wants: list[Want], tally: _Tally) -> dict[bytes, tuple[str, int]]:
    """Fetch, verify (on this thread) and store a few objects; returns their LMDB digests."""
    def get(want: Want) -> bytes | None | TqstoreError:
        try:
            return s3.get_object(want.key, want.sha256)
        except TqstoreError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(s3.concurrency, len(wants)))) as pool:
        payloads = list(pool.map(get, wants))
    verified = {}
    for want, payload in zip(wants, payloads):
        what = f"{want.kind} {want.key.hex()[:12]}"
        if isinstance(payload, TqstoreError):
            raise payload
        if payload is None:
            raise NotFound(f"the bucket lacks {what}, which its manifest lists: push the entry again from a machine "
                           "that has it")
        try:
            decode(payload, want, want.sha256)  # the S3 tier just verified the bytes against it
        except ConflictError as exc:
            raise ConflictError(f"the bucket's {what} belongs to another save ({exc}): push the entry again") from None
        except BAD_CONTENT as exc:
            raise CorruptBlock(f"the bucket's {what} is damaged ({exc}): push the entry again from a machine that "
                               "has it") from None
        verified[want.key] = payload
    tiers.lmdb.put_objects(verified, sha256s={w.key: w.sha256 for w in wants if w.sha256 is not None})
    digests = {}
    for key, payload in verified.items():
        info = tiers.lmdb.object_info(key)
        if info is None:
            raise NotFound(f"object {key.hex()[:12]} vanished right after it was stored: retry the pull")
        digests[key] = (info.sha256, info.size)
        tally.count(len(payload))
    return digests
