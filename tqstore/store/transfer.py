"""Moving entries between the LMDB store and the bucket: push and pull.

Push uploads the objects the bucket lacks as packs (layout 2, packs.py): what the bucket holds
is known from the remote index (its manifests and their maps) and confirmed by one LIST of the
packs (a HEAD only for a layout-1 object), so an object the bucket holds is never sent again;
the new objects go up streamed from LMDB into a few create-only multipart uploads named by
their index, so a push cut off and run again finds the packs it finished. A pack the bucket lists
under the name of one a push would write is kept only when a HEAD shows it is that pack (its size,
and its ETag the MD5 of the bytes; encrypted, whose bytes differ at every push: read back, each
member verified), and replaced otherwise: the name binds the index, not the bytes, so a pack
damaged in the bucket keeps its name, and `rm --remote` then `push` must not keep it. Objects the
remote index places only by an earlier push of this process, which no manifest of the bucket
lists now (their entry removed), are planned again and confirmed the same way. Then the manifest's
map, then the manifest last with a conditional write: created with If-None-Match, or replaced
with If-Match when the bucket still holds the version this entry was last pushed as or pulled
from. Any other manifest under that name is a ConflictError, unless it describes the same entry.
All of it under the bucket's push lock (bucket_locks.py), taken before anything is listed: a
remote gc on another machine deletes nothing meanwhile.

Pull publishes the bucket's entry locally by the path put and import take (publish.py): the
objects LMDB lacks are downloaded (ranged GETs of their packs, or whole layout-1 objects) and
verified completely on other threads as they arrive (digest from the bucket's manifest, then
format, identity, tokens and keys), written, then the manifest.

Block 0's key does not cover its calibration (see put.py): when the destination already holds a
block 0 (or window) of another save under the same key, the transfer stops with ConflictError
before any manifest is written, since the entry's later blocks would not fit that copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqstore.errors import ConflictError, CorruptBlock, FormatError, NotFound, TqstoreError
from tqstore.format.manifest import Manifest
from tqstore.format.objects import parse as parse_object
from tqstore.store.bucket import fetch_objects
from tqstore.store.bucket_locks import LockHolder, push_lock
from tqstore.store.packs import (PACK_BYTES, Location, Member, PackPlan, manifest_address, map_bytes, parse_map,
                                 parse_trailer, plan_packs, trailer_length)
from tqstore.store.publish import Batch, publish
from tqstore.store.remote_index import Located
from tqstore.store.tierset import TierSet, check_name
from tqstore.store.object_checks import BAD_CONTENT, Want, check_parsed, decode, wants_for

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

Progress = Callable[[int, int, int], None]  # (objects done, objects in all, bytes transferred)
WRITE_BATCH = 4 * 1024 * 1024  # bytes of verified objects a pull writes to LMDB at once
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
    conflicts: tuple[str, ...] = ()  # push --all: entries not pushed, the bucket holding others of their names


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
    warnings: list[str] = []
    now = time.time()
    if name is not None:
        manifests = [tiers.require_manifest(name)]
        if manifests[0].lapsed(now):  # as `--all` leaves it out: no machine would use it
            raise NotFound(f"{manifests[0].lapse_reason('the bucket')}: nothing was pushed; save it again (tqstore gc removes "
                           "expired entries)")
    else:
        entries, _ = tiers.local_manifests()  # unreadable ones are left out; `tqstore verify` names them
        manifests = sorted((m for m, _ in entries if not m.lapsed(now)), key=lambda m: m.name)
        # Expired ones are gc's to remove; a pinned one past its TTL lives on here, so say why it stays.
        warnings += [f"{m.lapse_reason('the bucket')}: not pushed" for m, _ in entries if m.pinned and m.lapsed(now)]
    tally = _Tally(sum(len({r.key for r in m.objects}) for m in manifests), progress)
    _check_key(tiers, s3, [m.name for m in manifests])
    up_to_date: list[str] = []
    pushed: list[str] = []
    conflicts: list[str] = []
    # The bucket's push lock before anything is decided: no remote gc deletes an object between
    # this push's listing and its manifest (bucket_locks.py).
    with push_lock(s3) as lock:
        # What the bucket holds (the first use LISTs and reads its manifests): the objects they list.
        listed = {r.key for m, _ in tiers.remote.manifests() for r in m.objects}
        packs = s3.list_packs()
        for manifest in manifests:
            try:
                if not _push_one(tiers, s3, manifest, tally, packs, listed, warnings, lock):
                    up_to_date.append(manifest.name)
                pushed.append(manifest.name)
            except ConflictError as exc:
                if name is not None:
                    raise
                # One entry another machine pushed differently must not keep the others local.
                conflicts.append(manifest.name)
                warnings.append(str(exc))
    return TransferStats(tuple(pushed), tally.total, tally.transferred, tally.skipped, tally.bytes,
                         time.perf_counter() - start, tuple(up_to_date), warnings=tuple(warnings),
                         conflicts=tuple(conflicts))


def _push_one(tiers: TierSet, s3: S3Tier, manifest: Manifest, tally: _Tally, packs: dict[str, tuple[int, float]],
              listed: set[bytes], warnings: list[str], lock: LockHolder) -> bool:
    """Push one entry: its objects, its map, then its manifest; False when the bucket already
    held it identically. ConflictError when the bucket holds a different entry of that name.
    `lock`: the push's bucket lock, checked before the manifest is written."""
    located = _upload(tiers, s3, manifest, tally, packs, listed, warnings)
    digests = {key: found[:2] for key, found in located.items()}
    remote = manifest.with_digests(digests).replace(pinned=False, remote_etag=None)
    where = {key: found[2] for key, found in located.items()}
    if not _map_there(tiers, s3, remote, where, lock.taken):  # a push of what the bucket holds sends nothing
        s3.put_map(manifest_address(remote), map_bytes(remote, where))
        tiers.remote.note_map(remote, where)
    lock.check()
    manifest = _intend(tiers, manifest, remote)
    etag, written = _publish_manifest(s3, manifest, remote, where)
    # Unless replaced meanwhile; bookkeeping, not use: the entry's place in eviction stays.
    tiers.lmdb.replace_manifest(manifest.name, manifest.to_bytes(), manifest.replace(remote_etag=etag).to_bytes(),
                                mark_used=False)
    tiers.remote.note_located(located)
    tiers.remote.note_manifest(remote, etag)
    listed.update(located)
    return written


def _map_there(tiers: TierSet, s3: S3Tier, remote: Manifest, where: Mapping[bytes, Location], since: float) -> bool:
    """Whether the bucket holds `remote`'s map placing its objects at `where`: seen by the remote
    index under this push's lock (taken at `since`), else read now. Not trusted from what this
    process wrote or read before: a remote gc on another machine may have deleted it since (its
    entry removed), and the manifest written next would then name a map that is not there."""
    if tiers.remote.map_known(remote, where, since):
        return True
    if tiers.remote.map_known(remote, where, float("-inf")):  # known from before the lock: confirm it
        try:
            data = s3.get_map(manifest_address(remote))
            if data is not None and parse_map(data, remote) == dict(where):
                tiers.remote.note_map(remote, where)
                return True
        except (CorruptBlock, FormatError):
            pass  # damaged: written again
    return False


def _check_key(tiers: TierSet, s3: S3Tier, names: list[str]) -> None:
    """EncryptionKeyError, before anything is written, when this machine's key (or its lack of
    one) cannot open the bucket's manifests: those of the entries pushed, and one other as a probe
    of the prefix; without a key, any encrypted manifest of the prefix (as the remote index, which
    reads them all, found them just now). A push with another key or none went on to replace the
    entry's map and upload packs (plaintext without a key) before its manifest check failed, and
    every machine with the right key could no longer pull the entry; a new entry went up readable
    into an encrypted prefix, also when the one manifest probed was a plaintext one pushed before
    encryption was turned on. One GET per entry and one more: the manifest write reads it again
    (compare-and-swap)."""
    from tqstore.store.crypto import KEY_ENV, EncryptionKeyError  # here: `cryptography` loads only with a bucket

    if s3.cipher is None:
        tiers.remote.refresh()
        sealed = tiers.remote.sealed()
        if sealed:
            raise EncryptionKeyError(f"s3://{s3.bucket}/{s3.prefix} holds encrypted entries ({', '.join(sealed[:3])}"
                                     f"{', ...' if len(sealed) > 3 else ''}) and this machine has no key: set "
                                     f"{KEY_ENV} or s3.key_file to the bucket's key; nothing was pushed (it would "
                                     "have gone up in clear)")
    wanted = set(names)
    probe = next((info.name for info in s3.list_manifests() if info.name not in wanted), None)
    for name in [*names, *([probe] if probe is not None else [])]:
        try:
            s3.get_manifest(name)
        except EncryptionKeyError as exc:
            raise EncryptionKeyError(f"{exc}; nothing was pushed") from None
        except CorruptBlock:
            pass  # a damaged manifest, or one sealed by an older tqstore: the manifest write decides


def _upload(tiers: TierSet, s3: S3Tier, manifest: Manifest, tally: _Tally, packs: dict[str, tuple[int, float]],
            listed: set[bytes], warnings: list[str]) -> dict[bytes, Located]:
    """Upload what the bucket lacks as packs; returns {key: (sha256, size, location) of the
    bucket's copy}. What the bucket holds is known from the remote index (its manifests and
    their maps), confirmed by `packs` (one LIST per push) or, for a layout-1 object, a HEAD.
    An object no manifest of the bucket lists (`listed`) is planned again, whatever this
    process pushed before: its entry was removed from the bucket, maybe for a damaged pack.

    Block 0 and the window are checked first: if the bucket holds them from another save, the
    push stops before uploading anything.
    """
    wants = {w.key: w for w in wants_for(manifest, len(manifest.blocks), remote=False)}
    refs = list({r.key: r for r in manifest.objects}.values())
    located = {key: found for key, found in tiers.remote.locate(r.key for r in refs).items()
               if key in listed and _still_there(s3, key, found, packs)}
    unbound = {manifest.window.key, *(r.key for r in manifest.blocks[:1])}  # keys that do not hash calibration
    for ref in refs:
        if ref.key in unbound and ref.key in located and located[ref.key][0] != ref.sha256:
            _check_bucket_copy(s3, manifest, wants[ref.key], located[ref.key])
    for ref in refs:
        if ref.key in located:
            tally.count(None)
    missing = [Member(r.key, r.sha256, r.size, r.size + s3.overhead) for r in refs if r.key not in located]
    plans = plan_packs(missing, s3.sealed_by, PACK_BYTES or s3.part_size)
    for plan in plans:
        located |= {k: (m.sha256, m.size, loc) for m, (k, loc) in zip(plan.members, plan.locations().items())}
    _send(tiers, s3, manifest, wants, plans, packs, tally, warnings)
    return located


def _send(tiers: TierSet, s3: S3Tier, manifest: Manifest, wants: Mapping[bytes, Want], plans: list[PackPlan],
          packs: dict[str, tuple[int, float]], tally: _Tally, warnings: list[str]) -> None:
    """Upload `plans`, up to `concurrency` at once: each pack read from LMDB (on this thread)
    just before it is sent, so at most `concurrency` packs are held. A pack `packs` lists (a
    push cut off after it, or an entry removed and pushed again) is kept if it is sound
    (`_place`). The first error stops what has not started and is raised (finished packs
    stay: a retried push keeps them)."""
    with ThreadPoolExecutor(max_workers=s3.concurrency, thread_name_prefix="tqstore-push") as pool:
        sending: deque[tuple[PackPlan, int, Future[str]]] = deque()

        def finish() -> None:
            plan, size, future = sending.popleft()
            outcome = future.result()
            packs[plan.name] = (size, time.time())
            for m in plan.members:
                tally.count(None if outcome == "kept" else m.size)
            if outcome == "replaced":
                warnings.append(f"the bucket's pack {plan.name[:12]} (of entry {manifest.name}) was not the pack this "
                                "push writes (damaged in the bucket, or a server whose ETags are not MD5s): sent again")

        try:
            for plan in plans:
                if len(sending) >= s3.concurrency:
                    finish()
                body = b"".join(_bodies(tiers, s3, manifest, wants, plan))
                sending.append((plan, len(body), pool.submit(_place, s3, plan, body, plan.name in packs)))
            while sending:
                finish()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _place(s3: S3Tier, plan: PackPlan, body: bytes, listed: bool) -> str:
    """Put pack `plan` (its bytes `body`) in the bucket: "sent", "kept" (the bucket listed it
    and holds that very pack: a push cut off after it) or "replaced" (it listed another body
    under the name: a pack damaged in the bucket, metadata kept, is named by its index as
    before; deleted, then created again). Packs stay create-only otherwise."""
    if not listed:
        s3.put_pack(plan.name, body)
        return "sent"
    if _holds(s3, plan, body):
        return "kept"
    s3.delete_packs([plan.name])
    s3.put_pack(plan.name, body)  # False: another push wrote it since the delete (a sound copy)
    return "replaced"


def _holds(s3: S3Tier, plan: PackPlan, body: bytes) -> bool:
    """Whether the bucket's pack `plan.name` is `body` (one HEAD: its size and ETag, which a
    server computes from the bytes it stores, not the metadata a copy keeps) or, encrypted (the
    envelopes' nonces differ at every push, so no two pushes write the same bytes), a pack of
    the same members: read back (only on this path) and every member and the index opened and
    verified against the manifest's digests."""
    from tqstore.store.crypto import EncryptionKeyError  # here: `cryptography` loads only with a bucket

    head = s3.pack_head(plan.name)
    if head is None or head[0] != len(body):
        return False  # removed since the LIST, or another body
    if s3.sealed_by is None:
        return head[1] == s3.upload_etag(body)
    pieces = s3.read_range(plan.name, 0, [off + m.length for m, off in zip(plan.members, plan.offsets)] + [len(body)])
    try:
        for m, off, piece in zip(plan.members, plan.offsets, pieces):
            if piece is None:
                return False
            s3.open_member(plan.name, off, piece, m.key, m.sha256)
        trailer = next(pieces, None)
        return (trailer is not None and trailer_length(trailer) == len(trailer)
                and parse_trailer(trailer, plan.name, lambda blob: s3.open_index(plan.name, blob)) ==
                [(m.key, m.sha256, off, m.length) for m, off in zip(plan.members, plan.offsets)])
    except (CorruptBlock, FormatError, EncryptionKeyError):  # the key error: sealed by another key
        return False
    finally:
        pieces.close()


def _still_there(s3: S3Tier, key: bytes, found: Located, packs: Mapping[str, tuple[int, float]]) -> bool:
    """Whether the bucket still holds the copy the remote index places at `found` (a pack in
    this push's LIST, or a layout-1 object a HEAD finds)."""
    loc = found[2]
    if loc.pack is not None:
        return loc.pack in packs and loc.offset + loc.length <= packs[loc.pack][0]
    info = s3.object_info(key)
    return info is not None and info.sha256 == found[0]


def _bodies(tiers: TierSet, s3: S3Tier, manifest: Manifest, wants: Mapping[bytes, Want],
            plan: PackPlan) -> Iterator[bytes]:
    """The pieces of pack `plan`: its members read from LMDB (each checked against the
    manifest's digest), then its index and footer."""
    for m in plan.members:
        what = f"{wants[m.key].kind} {m.key.hex()[:12]}"
        try:
            found = tiers.lmdb.get_verified(m.key)  # hashed once here, the digest checked against the manifest
        except CorruptBlock as exc:
            raise CorruptBlock(f"entry {manifest.name} cannot be pushed: {exc}; save it again") from None
        if found is None:
            raise NotFound(f"entry {manifest.name} cannot be pushed: its {what} is missing from the local store "
                           "(tqstore verify); save it again")
        if found[1] != m.sha256 or len(found[0]) != m.size:
            raise CorruptBlock(f"entry {manifest.name} cannot be pushed: the stored {what} is not the copy the entry "
                               "recorded (tqstore verify); save it again")
        body = s3.seal_object(m.key, found[0])
        if len(body) != m.length:
            raise CorruptBlock(f"the sealed {what} is {len(body)} bytes where {m.length} were planned")
        yield body
    yield plan.trailer(s3.seal_index(plan.name, plan.index))


def _check_bucket_copy(s3: S3Tier, manifest: Manifest, want: Want, found: Located) -> None:
    """The bucket holds other bytes under a key that does not bind calibration: same save, or
    ConflictError."""
    for _, result in fetch_objects(s3, [(dataclasses.replace(want, sha256=found[0]), found[2])],
                                   lambda w, payload: decode(payload, w, w.sha256)):
        if result is None:
            return  # deleted meanwhile; the manifest still records what was found
        if isinstance(result, ConflictError):
            raise ConflictError(f"entry {manifest.name} cannot be pushed: the bucket already holds its first tokens "
                                f"from another save ({result}); pull the bucket's entry with that prefix and continue "
                                "from it, or remove it from the bucket (tqstore rm --remote, gc --remote)") from None
        if isinstance(result, BAD_CONTENT + (CorruptBlock,)):
            raise CorruptBlock(f"the bucket's copy of {want.kind} {want.key.hex()[:12]} is damaged ({result}): "
                               "remove the entries using it from the bucket (tqstore rm --remote, then gc --remote) "
                               "and push again") from None
        if isinstance(result, TqstoreError):
            raise result


def _intend(tiers: TierSet, local: Manifest, remote: Manifest) -> Manifest:
    """Record, before the bucket's manifest is written, which version this push writes and which
    it replaces (`remote_etag` = PENDING + old etag + ":" + sha256 of the new manifest): a push
    cut off after the write, before it recorded the new etag, then still recognises the bucket's
    version as its own. Returns the local manifest as recorded (unless replaced meanwhile)."""
    pending = local.replace(remote_etag=f"{PENDING}{local.remote_etag or ''}:"
                                        f"{hashlib.sha256(remote.to_bytes()).hexdigest()}")
    if not tiers.lmdb.replace_manifest(local.name, local.to_bytes(), pending.to_bytes(), mark_used=False):
        return local  # replaced meanwhile
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


def _publish_manifest(s3: S3Tier, local: Manifest, remote: Manifest,
                      where: Mapping[bytes, Location]) -> tuple[str, bool]:
    """Write the bucket's manifest `remote`, whose objects lie at `where` (its map is written);
    returns (its etag, whether it was written)."""
    from tqstore.store.crypto import UnboundManifest  # here: `cryptography` loads only with a bucket

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
        if _unchanged(s3, existing, remote, where):
            return etag, False
        # The same entry with another expiry or metadata (re-saved with or without --ttl),
        # expired in the bucket, or naming copies of its objects the bucket lost: brought to
        # this push's, if nobody replaced it since it was read.
        return _write(s3, local.name, remote.to_bytes(), etag), True
    if _ours(local.remote_etag, etag, data):  # the bucket still holds our ancestor
        return _write(s3, local.name, remote.to_bytes(), etag), True
    raise ConflictError(f"the bucket already holds a different entry {local.name} (pushed from another machine or "
                        f"another save): pull it (it replaces the local entry), or push under another name")


def _unchanged(s3: S3Tier, existing: Manifest, remote: Manifest, where: Mapping[bytes, Location]) -> bool:
    """Whether the bucket's manifest `existing`, the same entry as the one this push would write
    (`same_content`), may stay as it is: not expired, with the expiry and metadata this push's
    copy has (which same_content leaves out: they are not what the entry holds, but the bucket's
    copy must not expire before or after the local one), and naming the very copies of its
    objects this push found or sent (same digests), placed by its map where they lie now
    (`where`, confirmed under this push's lock). Otherwise the bucket's manifest may name a copy
    the bucket lost (a pack of another save's block 0, say) while this push sent its own: kept,
    the entry could not be pulled, and pushing it again did not heal it."""
    if existing.expired(time.time()) or existing.expires != remote.expires or existing.metadata != remote.metadata:
        return False
    if [(r.key, r.sha256, r.size) for r in existing.objects] != [(r.key, r.sha256, r.size) for r in remote.objects]:
        return False
    if manifest_address(existing) == manifest_address(remote):
        return True  # its map is the one this push wrote or confirmed
    try:  # another machine's manifest of the same entry (created elsewhere): one GET of its map
        data = s3.get_map(manifest_address(existing))
        placed = {r.key: Location(None) for r in existing.objects} if data is None else parse_map(data, existing)
    except (CorruptBlock, FormatError):
        return False
    return placed == dict(where)


def pull(tiers: TierSet, name: str, progress: Progress | None) -> TransferStats:
    """Download entry `name` from the bucket into LMDB; see the module docstring. The local entry of
    that name, if any, is replaced (its pin is kept)."""
    s3 = tiers.require_s3()
    start = time.perf_counter()
    got = s3.get_manifest(name)
    if got is None:
        raise NotFound(f"no entry {name} in s3://{s3.bucket}/{s3.prefix}: `tqstore ls --remote` lists the entries")
    # The map is named by the sha256 of the manifest's canonical bytes, which are the bytes read
    # for any manifest tqstore wrote: its GET starts while the manifest is parsed and checked.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tqstore-map") as early:
        guess = hashlib.sha256(got[0]).hexdigest()
        fetching = early.submit(s3.get_map, guess)
        remote = check_name(Manifest.from_bytes(got[0]), name)
        if remote.expired(time.time()):  # it would never be matched or loaded, yet could evict live entries
            raise NotFound(f"entry {name} in s3://{s3.bucket}/{s3.prefix} expired at {time.ctime(remote.expires)}: "
                           "nothing was pulled; push it again from a machine that has it live (tqstore gc --remote "
                           "removes expired entries)")
        where = _map(s3, remote, fetching if manifest_address(remote) == guess else None)
    wants = wants_for(remote, len(remote.blocks), remote=True)
    tally = _Tally(len(wants), progress)
    published = publish(tiers, name, wants, _Bucket(s3, where),
                        lambda digests, old: remote.with_digests(digests).replace(
                            remote_etag=got[1], pinned=old is not None and old.pinned),
                        tally.count_once)
    tiers.remote.note_manifest(remote, got[1])
    return TransferStats((name,), tally.total, tally.transferred, tally.skipped, tally.bytes,
                         time.perf_counter() - start, evicted=published.evicted, warnings=published.warnings)


def _map(s3: S3Tier, remote: Manifest, fetching: Future[bytes | None] | None = None) -> dict[bytes, Location]:
    """Where the bucket's entry `remote` has its objects: its map (`fetching`, when its GET has
    started), or loose (layout 1: no map)."""
    try:
        data = s3.get_map(manifest_address(remote)) if fetching is None else fetching.result()
        return {} if data is None else parse_map(data, remote)
    except (CorruptBlock, FormatError) as exc:
        raise CorruptBlock(f"the bucket's map of entry {remote.name} (where its objects lie) is damaged ({exc}): "
                           "push the entry again from a machine that has it") from None


class _Bucket:
    """The bucket's objects as a publish source: fetched as a pipeline (bucket.py: ranged GETs
    of packs, verification on other threads), in bounded memory."""

    action = "pull"
    advice = "remove those entries (tqstore rm) and pull again"

    def __init__(self, s3: S3Tier, where: Mapping[bytes, Location]) -> None:
        self.s3, self.where = s3, where

    def expected(self, want: Want) -> str | None:
        """The digest the bucket's manifest records."""
        return want.sha256

    def payloads(self, missing: list[Want], kept: object) -> Iterator[Batch]:
        """Download, verify and yield `missing` in batches of up to 2 x concurrency objects and
        about WRITE_BATCH bytes, in the order they are verified (the packs download side by
        side: the first objects of each are written while the rest arrives); the downloads and
        checks go on while the caller writes a batch. The first problem met is raised."""
        step, size = 2 * self.s3.concurrency, 0
        batch: Batch = {}
        located = [(w, self.where.get(w.key, Location(None))) for w in missing]
        for want, result in fetch_objects(self.s3, located, _verified, ordered=False):
            if result is None:
                raise NotFound(f"the bucket lacks {want.kind} {want.key.hex()[:12]}, which its manifest lists: push "
                               "the entry again from a machine that has it")
            if isinstance(result, TqstoreError):
                raise result
            batch[want.key] = result
            size += len(result[0])
            # Written while the rest downloads: batches of a few MiB keep the LMDB writes
            # overlapped with the GETs (a write costs about as much per byte as a download here).
            if len(batch) == step or size >= WRITE_BATCH:
                yield batch
                batch, size = {}, 0
        if batch:
            yield batch


def _verified(want: Want, payload: bytes) -> tuple[bytes, str]:
    """`want`'s payload verified in full (its digest was just checked), with its digest. Every
    check of `decode` without building the arrays, which a pull only writes (building them cost
    more CPU than hashing the payload: 18 ms against 16 ms for a 4k-token turbo4 entry), except
    for shared codecs, which are checked by the digest of the codecs built."""
    what = f"{want.kind} {want.key.hex()[:12]}"
    try:
        if want.kind == "shared":
            decode(payload, want, want.sha256)
        else:
            check_parsed(parse_object(payload, expect=want.expect, verified=True), want)
    except ConflictError as exc:
        raise ConflictError(f"the bucket's {what} belongs to another save ({exc}): push the entry again") from None
    except BAD_CONTENT as exc:
        raise CorruptBlock(f"the bucket's {what} is damaged ({exc}): push the entry again from a machine that has it"
                           ) from None
    return payload, want.sha256
