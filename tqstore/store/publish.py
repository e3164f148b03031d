"""Publishing an entry in the LMDB tier: its objects first, the manifest last. The one path that
put (a freshly encoded snapshot), pull (the bucket) and import (a bundle file) take; each passes
the objects the entry needs and an `ObjectSource` that yields the payloads of those LMDB lacks.

1. Budget: a store over its LMDB budget (lowered after a DiskFull, say) makes room first; on a
   full disk the eviction that follows the write would otherwise never be reached.
2. Under the home lock held shared (tierset.py: no gc deletes what is written but not yet
   referenced), plan every object: an LMDB copy is kept unread when it is the very copy the
   source expects (same sha256; the tier checks its segments on every read), else it is read
   and verified in full (object_checks.py). A damaged copy is quarantined and written again; a good
   copy of another save (block 0 calibrated differently) is a ConflictError, since the entry's
   later blocks cannot be combined with it. An object already stored is never rewritten.
3. Write the missing objects the source yields, batch by batch (each batch committed on a
   thread while the source makes the next), and check each landed as written: another process
   may have stored its own copy of a key first, and then the plan is made again (it finds that
   copy stored).
4. Write the manifest the caller builds from the digests of the stored copies, in the
   transaction of the last batch: a put of up to 64 MiB is one synced commit, and the entry
   becomes visible with its last objects or not at all.
5. Pins, and the budget again (never evicting the entry just published).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from tqstore.errors import ConflictError, CorruptBlock, FormatError
from tqstore.format.manifest import Manifest
from tqstore.store.maintenance import drop_if_expired, enforce_budget
from tqstore.store.tiers.base import ObjectInfo
from tqstore.store.tiers.memory import HotObject
from tqstore.store.tierset import TierSet
from tqstore.store.object_checks import BAD_CONTENT, Want, decode, quarantine_lmdb

Digests = Mapping[bytes, tuple[str, int]]  # key -> (sha256, size) of the stored copy
# key -> (verified payload: bytes, or consecutive buffers that joined are its bytes; its sha256)
Batch = dict[bytes, tuple[bytes | Sequence[memoryview], str]]
_ATTEMPTS = 3


class ObjectSource(Protocol):
    """Where a publish gets the objects LMDB lacks. `action` ("save", "pull", "import") and
    `advice` (what to do about a first block stored from another save) go into messages."""

    action: str
    advice: str

    def expected(self, want: Want) -> str | None:
        """The sha256 of the copy this source holds of `want`, when known before writing."""

    def payloads(self, missing: list[Want], kept: Mapping[bytes, HotObject | None]) -> Iterator[Batch]:
        """Batches of verified payloads for `missing`. `kept` holds the LMDB copies the plan
        kept, decoded where they were read (None: kept unread, being the expected copy)."""


@dataclass(frozen=True)
class Published:
    """What a publish stored: the manifest, the objects it wrote (key -> payload bytes), the
    entries the budget evicted before and after, and the budget's warnings."""

    manifest: Manifest
    written: dict[bytes, int]
    evicted: tuple[str, ...]
    warnings: tuple[str, ...]


def publish(tiers: TierSet, name: str, wants: Sequence[Want], source: ObjectSource,
            build: Callable[[Digests, Manifest | None], Manifest],
            progress: Callable[[bytes, int | None], None] | None = None) -> Published:
    """Publish entry `name` made of `wants` (see the module docstring). `build(digests, old)`
    makes the manifest from the stored copies' digests and the entry it replaces (None if none,
    or unreadable: a damaged manifest is simply replaced). `progress(key, nbytes)` follows each
    object: kept (None) or written."""
    before, _ = enforce_budget(tiers, keep=name)
    written: dict[bytes, int] = {}
    for _ in range(_ATTEMPTS):
        try:
            with tiers.lock.shared():
                manifest = _store(tiers, name, wants, source, build, written, progress)
        except _Stale as stale:
            # Only expired entries (or none) hold the other copy: they go, and the plan is made again.
            before += drop_if_expired(tiers, stale.key)
            manifest = None
        if manifest is not None:
            break
    else:
        raise ConflictError(f"other processes kept storing different copies of the objects of {name}: retry")
    if manifest.pinned:
        tiers.refresh_pins()
    else:
        tiers.ensure_pins()
    after, warnings = enforce_budget(tiers, keep=name)
    return Published(manifest, written, tuple(before + after), tuple(warnings))


def _store(tiers: TierSet, name: str, wants: Sequence[Want], source: ObjectSource,
           build: Callable[[Digests, Manifest | None], Manifest], written: dict[bytes, int],
           progress: Callable[[bytes, int | None], None] | None) -> Manifest | None:
    """One plan, its writes and the manifest: the manifest written, or None when another
    process stored a different copy of an object meanwhile (nothing then refers to ours).

    Batches before the last are committed on a thread while the source makes the next one; the
    last batch and the manifest commit in one transaction (lmdb.py `put_objects`)."""
    digests: dict[bytes, tuple[str, int]] = {}
    kept: dict[bytes, HotObject | None] = {}
    missing = []
    for want in wants:
        try:
            found = _local_copy(tiers, want, source.expected(want))
        except ConflictError as exc:
            entries, unreadable = tiers.local_manifests()
            users = [m for m, _ in entries if want.key in {r.key for r in m.objects}]
            now = time.time()
            if not unreadable and all(m.expired(now) for m in users):
                raise _Stale(want.key) from None
            users = [m.name for m in users]
            raise ConflictError(f"cannot {source.action} {name}: this store holds its first tokens from another save "
                                f"({exc}), used by {', '.join(users) or 'no entry'}; {source.advice}") from None
        if found is None:
            missing.append(want)
            continue
        info, kept[want.key] = found
        digests[want.key] = (info.sha256, info.size)
        if progress is not None:
            progress(want.key, None)
    left = {w.key for w in missing}
    made: list[Manifest] = []
    complete = True

    def landed(batch: Batch, infos: Mapping[bytes, ObjectInfo]) -> bool:
        ok = True
        for key, (_, digest) in batch.items():
            info = infos.get(key)
            if info is None or info.sha256 != digest:
                ok = False  # another writer stored its copy first (existing keys are skipped)
                continue
            digests[key] = (info.sha256, info.size)
            written[key] = info.size
            if progress is not None:
                progress(key, info.size)
        return ok

    def write(batch: Batch, manifest=None) -> None:
        tiers.lmdb.put_objects({k: p for k, (p, _) in batch.items()}, sha256s={k: d for k, (_, d) in batch.items()},
                               **({} if manifest is None else {"manifest": manifest}))

    def finish(batch: Batch) -> None:
        """The last batch and the manifest, in one transaction (on the writer thread)."""
        old = _old_manifest(tiers, name)

        def make(infos: dict[bytes, ObjectInfo]) -> bytes | None:
            if not (landed(batch, infos) and complete):
                return None
            made.append(build(digests, old))
            return made[-1].to_bytes()

        write(batch, (name, make))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tqstore-publish") as writer:
        writing: tuple[Batch, Future] | None = None
        batches = source.payloads(missing, kept)
        for batch in batches:
            left -= batch.keys()
            if writing is not None:
                writing[1].result()
                complete &= landed(writing[0], _infos(tiers, writing[0]))
                writing = None
            if left:
                writing = (batch, writer.submit(write, batch))
            else:
                last = writer.submit(finish, batch)
                for extra in batches:  # the source's work after its last batch runs beside the commit
                    raise RuntimeError(f"the {source.action} source gave objects it was not asked for: "
                                       f"{sorted(k.hex()[:12] for k in extra)}")
                last.result()
                return made[0] if made else None
        if writing is not None:
            writing[1].result()
            complete &= landed(writing[0], _infos(tiers, writing[0]))
    if not complete:
        return None
    manifest = build(digests, _old_manifest(tiers, name))
    tiers.lmdb.put_manifest(name, manifest.to_bytes())
    return manifest


def _infos(tiers: TierSet, batch: Batch) -> dict[bytes, ObjectInfo]:
    return {key: info for key in batch if (info := tiers.lmdb.object_info(key)) is not None}


def _old_manifest(tiers: TierSet, name: str) -> Manifest | None:
    """The entry a publish replaces (None if none, or unreadable: a damaged manifest is replaced)."""
    try:
        return tiers.local_manifest(name)
    except FormatError:
        return None


class _Stale(Exception):
    """An object of another save that no live entry uses is in the way of this one."""

    def __init__(self, key: bytes):
        super().__init__(key.hex())
        self.key = key


def _local_copy(tiers: TierSet, want: Want, expected: str | None) -> tuple[ObjectInfo, HotObject | None] | None:
    """The LMDB copy of `want` to keep (with the object decoded when it was read), or None to
    write one. ConflictError for a good copy of another save."""
    info = tiers.lmdb.object_info(want.key)
    if info is None:
        return None
    if info.sha256 == expected:
        return info, None
    try:
        found = tiers.lmdb.get_verified(want.key)
    except CorruptBlock:  # quarantined by the tier
        return None
    if found is None:
        return None
    try:
        return info, decode(found[0], want, found[1])
    except BAD_CONTENT as exc:
        quarantine_lmdb(tiers.lmdb, want.key, f"{type(exc).__name__}: {exc}")
        return None
