"""Removing and checking entries: budget eviction, rm, gc, verify.

Every operation that deletes objects holds the home lock exclusively (home_lock.HomeLock), so no
put or pull is between writing its objects and publishing its manifest meanwhile: an object no
manifest references is then truly garbage (an orphan of a killed writer, a leftover of an
evicted entry, or a copy promoted from S3 by a prefix restore). When a manifest cannot be read
(damaged, or written by a newer tqstore) nobody knows what it references, so no object is
collected and the caller is told why.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqstore.units import format_size
from tqstore.errors import ConflictError, CorruptBlock, DiskFull, FormatError, NotFound, TqstoreError
from tqstore.store.bucket_locks import LockHolder, gc_lock
from tqstore.store.crypto import EncryptionKeyError
from tqstore.store.object_checks import BAD_CONTENT, Want, codec_problem, decode, quarantine_lmdb, wants_for
from tqstore.format.manifest import Manifest
from tqstore.names import is_valid_name
from tqstore.store.packs import PACK_TAIL, manifest_address, parse_map, parse_trailer, trailer_length
from tqstore.store.tiers.lmdb import CompactResult
from tqstore.store.tiers.memory import HotObject
from tqstore.store.tierset import RemoteManifest, TierSet, not_found

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

REMOTE_GRACE = 3600.0  # seconds an unreferenced bucket object is left for a push in flight elsewhere


@dataclass(frozen=True)
class Problem:
    """One thing `verify` found: the entry (None for store-level problems), a kind, the object
    key if one is concerned, and what is wrong."""

    entry: str | None
    kind: str  # manifest, missing, corrupt, digest, content, other_save, or an LMDB kind (checksum, ...)
    key: bytes | None
    detail: str


@dataclass(frozen=True)
class GcStats:
    """What `gc` removed (locally, and in the bucket with remote=True)."""

    expired: tuple[str, ...] = ()
    orphans: int = 0
    orphan_bytes: int = 0
    quarantine_cleared: int = 0
    remote_expired: tuple[str, ...] = ()
    remote_orphans: int = 0
    remote_orphan_bytes: int = 0
    remote_maps: int = 0  # maps of no manifest (where a removed entry's objects lay)
    remote_map_bytes: int = 0
    compact: CompactResult | None = None
    notes: tuple[str, ...] = ()


def enforce_budget(tiers: TierSet, keep: str) -> tuple[list[str], list[str]]:
    """Evict until the LMDB objects fit `lmdb_budget_bytes`: unreferenced objects, then expired
    entries, then least recently used ones; pinned entries and `keep` (the entry just written)
    stay. Returns (evicted entry names, warnings)."""
    budget = tiers.config.lmdb_budget_bytes
    if tiers.lmdb.stats().payload_bytes <= budget:
        return [], []
    with tiers.lock.exclusive():
        used = tiers.lmdb.stats().payload_bytes
        entries, unreadable = tiers.local_manifests()
        if unreadable:
            return [], [f"the LMDB store is over its budget ({format_size(used)} of {format_size(budget)}) but "
                        f"manifests {', '.join(unreadable)} cannot be read, so nothing was evicted: run tqstore verify"]
        refs = Counter(key for m, _ in entries for key in _keys(m))
        objects, freed = _delete(tiers, [k for k in tiers.lmdb.iter_object_keys() if k not in refs])
        used -= freed
        now = time.time()
        order = sorted(((m, used_at) for m, used_at in entries if m.name != keep and not m.pinned),
                       key=lambda e: (not e[0].expired(now), e[1]))
        evicted = []
        for m, _ in order:
            if used <= budget:
                break
            tiers.lmdb.delete_manifest(m.name)
            refs.subtract(_keys(m))
            n, nbytes = _delete(tiers, [k for k in _keys(m) if refs[k] <= 0])
            used, objects, freed = used - nbytes, objects + n, freed + nbytes
            evicted.append(m.name)
        tiers.counters.evicted(len(evicted), objects, freed)
    warnings = []
    if used > budget:
        kept = next((m for m, _ in entries if m.name == keep), None)
        size = f" ({format_size(kept.nbytes)})" if kept is not None else ""
        warnings.append(f"the LMDB store holds {format_size(used)}, over its budget of {format_size(budget)}: what is "
                        f"left is pinned or the entry just written, {keep}{size}; raise store.lmdb_budget "
                        "(TQSTORE_LMDB_BUDGET) or unpin entries")
    return evicted, warnings


def drop_if_expired(tiers: TierSet, key: bytes) -> list[str]:
    """Delete LMDB object `key` when no live entry uses it, with the expired entries that do
    (their other objects no live entry uses go too); the entries dropped. Nothing when a live
    entry (or an unreadable manifest, which might be one) uses it. A save that meets a block
    0 of another calibration calls it: an expired entry is never matched by a lookup, so its
    blocks would refuse the same tokens for ever (until a gc)."""
    with tiers.lock.exclusive():
        entries, unreadable = tiers.local_manifests()
        now = time.time()
        users = [m for m, _ in entries if key in _keys(m)]
        if unreadable or any(not m.expired(now) for m in users):
            return []
        dropped = {m.name for m in users}
        for name in dropped:
            tiers.lmdb.delete_manifest(name)
        live = {k for m, _ in entries if m.name not in dropped for k in _keys(m)}
        freed = [k for k in {key, *(k for m in users for k in _keys(m))} if k not in live]
        _delete(tiers, freed)
        tiers.memory.drop(freed)
    return sorted(dropped)


def rm_local(tiers: TierSet, name: str) -> None:
    """Delete entry `name` and the objects no other entry uses; NotFound if there is none."""
    with tiers.lock.exclusive():
        try:
            manifest = tiers.local_manifest(name)
        except FormatError:
            manifest = None  # unreadable: remove it; gc collects its objects
        if not tiers.lmdb.delete_manifest(name):
            raise not_found(name, tiers)
        entries, unreadable = tiers.local_manifests()
        if manifest is not None and not unreadable:
            refs = {key for m, _ in entries for key in _keys(m)}
            freed = [k for k in _keys(manifest) if k not in refs]
            _delete(tiers, freed)
            tiers.memory.drop(freed)
    if manifest is not None and manifest.pinned:
        tiers.refresh_pins()


def rm_damaged_key(tiers: TierSet, label: str) -> bool:
    """Drop the manifest stored under a damaged key shown as `label`; False if there is none."""
    with tiers.lock.exclusive():
        records = [r for r in tiers.lmdb.damaged_records() if r.db == "manifests" and r.label == label]
        return tiers.lmdb.fix_records(records) > 0


def rm_remote(tiers: TierSet, name: str) -> None:
    """Delete the bucket's manifest `name` (its objects go at the next `gc --remote`)."""
    s3 = tiers.require_s3()
    if not s3.delete_manifest(name):
        raise NotFound(f"no entry {name} in s3://{s3.bucket}/{s3.prefix}: `tqstore ls --remote` lists them")
    tiers.remote.forget(name)


def gc(tiers: TierSet, *, remote: bool, compact: bool, remote_grace: float) -> GcStats:
    """Drop expired entries, unreferenced objects and quarantine records; the
    same in the bucket with `remote` (objects younger than `remote_grace` seconds stay: a push
    elsewhere may not have written its manifest yet); then compact LMDB if asked."""
    notes: list[str] = []
    if remote:
        # The bucket's lock first, then its manifests: an unreachable bucket stops gc before the
        # local part, and a push that finished before the lock is in the listing (bucket_locks.py).
        with gc_lock(tiers.require_s3()) as (lock, pushes):
            listing = tiers.remote_manifests()
            stats = _gc_local(tiers, notes)
            stats = _gc_remote(tiers, stats, remote_grace, notes, listing, lock, pushes)
    else:
        stats = _gc_local(tiers, notes)
    if compact:
        try:
            stats = dataclasses.replace(stats, compact=tiers.lmdb.compact())
        except (DiskFull, ConflictError) as exc:  # the store works without it: what gc removed is room again
            notes.append(f"compaction skipped: {exc}")
    return dataclasses.replace(stats, notes=tuple(notes))


def _gc_local(tiers: TierSet, notes: list[str]) -> GcStats:
    with tiers.lock.exclusive():
        entries, unreadable = tiers.local_manifests()
        now = time.time()
        expired = [m.name for m, _ in entries if m.expired(now)]
        for name in expired:
            tiers.lmdb.delete_manifest(name)
        orphans, orphan_bytes = 0, 0
        if unreadable:
            notes.append(_unreadable_note(unreadable, "the local store"))
        else:
            refs = {key for m, _ in entries if m.name not in expired for key in _keys(m)}
            orphans, orphan_bytes = _delete(tiers, [k for k in tiers.lmdb.iter_object_keys() if k not in refs])
        cleared = tiers.lmdb.clear_quarantine()
    return GcStats(tuple(expired), orphans, orphan_bytes, cleared)


def _gc_remote(tiers: TierSet, stats: GcStats, grace: float, notes: list[str],
               listing: tuple[list[RemoteManifest], list[str]], lock: LockHolder, pushes: int) -> GcStats:
    """Bucket gc: expired manifests; loose objects no live manifest lists; packs none of whose
    members a live manifest's map uses (a pack with one member in use stays whole: see
    docs/format.md); maps of no manifest. Everything younger than `grace` stays, and no object
    goes while `pushes` (live push locks seen under this gc's `lock`) is not 0: those pushes may
    reuse objects of entries expired or removed since their listing. What is deleted is forgotten
    by this process's remote index (RemoteIndex.collected). `listing`: the bucket's manifests as
    `TierSet.remote_manifests` read them after the lock was taken."""
    s3 = tiers.require_s3()
    live: list[Manifest] = []
    expired = []
    now = time.time()
    found, unreadable = listing
    for manifest in (remote.manifest for remote in found):
        if manifest.expired(now):
            s3.delete_manifest(manifest.name)
            tiers.remote.forget(manifest.name)
            expired.append(manifest.name)
        else:
            live.append(manifest)
    orphans, nbytes = [], 0
    if unreadable:
        notes.append(_unreadable_note(unreadable, f"s3://{s3.bucket}/{s3.prefix}"))
        return dataclasses.replace(stats, remote_expired=tuple(expired))
    if pushes:
        notes.append(f"{pushes} push{'es' if pushes > 1 else ''} to s3://{s3.bucket}/{s3.prefix} in flight (bucket "
                     "locks), which may reuse objects no manifest lists yet, so no object was removed: run gc "
                     "--remote again when they end")
        return dataclasses.replace(stats, remote_expired=tuple(expired))
    used, unmapped = _packs_in_use(s3, live)
    if unmapped:
        notes.append(f"the maps of entries {', '.join(unmapped)} in s3://{s3.bucket}/{s3.prefix} cannot be read, so "
                     "no unreferenced packs were removed: push those entries again (tqstore verify --remote)")
    refs = {key for m in live for key in _keys(m)}
    for key in s3.list_object_keys():
        if key in refs:
            continue
        try:
            info = s3.object_info(key)
        except CorruptBlock:  # unreadable metadata: not ours to keep
            orphans.append(key)
            continue
        if info is not None and now - info.created >= grace:
            orphans.append(key)
            nbytes += info.size
    packs: list[tuple[str, int]] = []
    maps: list[tuple[str, int]] = []
    lock.check()  # still held: no push decided meanwhile
    try:
        s3.delete_objects(orphans)
        packs = [] if unmapped else [(p, size) for p, (size, modified) in s3.list_packs().items()
                                     if p not in used and now - modified >= grace]
        s3.delete_packs(p for p, _ in packs)
        addresses = {manifest_address(m) for m in live}
        maps = [(a, size) for a, (size, modified) in s3.list_maps().items()
                if a not in addresses and now - modified >= grace]
        s3.delete_maps(a for a, _ in maps)
    finally:  # even after a failure: a later push of this process must not skip what it remembers writing
        tiers.remote.collected(orphans, (p for p, _ in packs), (a for a, _ in maps))
    return dataclasses.replace(stats, remote_expired=tuple(expired), remote_orphans=len(orphans) + len(packs),
                               remote_orphan_bytes=nbytes + sum(size for _, size in packs),
                               remote_maps=len(maps), remote_map_bytes=sum(size for _, size in maps))


def _packs_in_use(s3: S3Tier, live: list[Manifest]) -> tuple[set[str], list[str]]:
    """(packs holding a member some live manifest's map uses, entries whose map cannot be read)."""
    used: set[str] = set()
    unmapped = []
    for manifest in live:
        try:
            data = s3.get_map(manifest_address(manifest))
            where = {} if data is None else parse_map(data, manifest)
        except (CorruptBlock, FormatError):
            unmapped.append(manifest.name)
            continue
        used |= {loc.pack for loc in where.values() if loc.pack is not None}
    return used, unmapped


def verify(tiers: TierSet, name: str | None) -> list[Problem]:
    """Check every object of entry `name` (every entry by default) in LMDB: present, the
    recorded digest, and fully verified against what the entry expects; then LMDB's own check
    of every object and segment. Damaged copies are quarantined as a restore would."""
    problems: list[Problem] = []
    if name is not None:
        manifests = [tiers.require_manifest(name)]
    else:
        entries, unreadable = tiers.local_manifests()
        manifests = [m for m, _ in entries]
        problems += [Problem(n, "manifest", None, _unreadable_reason(tiers, n)) for n in unreadable
                     if is_valid_name(n)]  # invalid keys are among the damaged records below
        problems += [Problem(r.label if r.db == "manifests" else None, "record", r.key, f"{r.db}: {r.detail}")
                     for r in tiers.lmdb.damaged_records()]
    for manifest in manifests:
        decoded = {}
        for want, ref in zip(wants_for(manifest, len(manifest.blocks), remote=False), manifest.objects):
            found, hot = _check_object(tiers, manifest.name, want, ref.sha256)
            problems += found
            decoded[want.kind] = hot
        if decoded["window"] is not None and decoded["shared"] is not None:
            unfit = codec_problem(manifest, decoded["window"], decoded["shared"])
            if unfit is not None:
                problems.append(Problem(manifest.name, "manifest", None,
                                        f"the manifest does not fit its objects: {unfit}"))
    problems += [Problem(None, p.kind, p.key, p.detail) for p in tiers.lmdb.verify()]
    return problems


def verify_remote(tiers: TierSet, name: str | None) -> list[Problem]:
    """Check the bucket's manifest `name` (every one by default): it parses and, in an encrypted
    bucket, opens: sealed for the address it was read from (not copied from another prefix,
    bucket or name), by a tqstore that seals addresses, and no older than the version this
    machine has seen. Then where its objects lie: its map reads, every pack it uses is there
    with an index (read from the pack's end) that lists each member at the mapped range with
    the manifest's digest, and every layout-1 object is there. The objects' bytes are checked
    when an entry is pulled."""
    s3 = tiers.require_s3()
    found, unreadable = tiers.remote_manifests(None if name is None else [name])
    if name is not None and not found and not unreadable:
        raise NotFound(f"no entry {name} in s3://{s3.bucket}/{s3.prefix}: `tqstore ls --remote` lists them")
    problems = []
    for entry in unreadable:
        try:
            got = s3.get_manifest(entry)
            if got is None:
                continue  # removed meanwhile
            Manifest.from_bytes(got[0])
            detail = "the manifest could not be read (it was replaced meanwhile)"
        except (FormatError, CorruptBlock, EncryptionKeyError) as exc:
            detail = str(exc)
        problems.append(Problem(entry, "remote_manifest", None, detail))
    return problems + _check_placement(s3, [remote.manifest for remote in found])


def _check_placement(s3: S3Tier, manifests: list[Manifest]) -> list[Problem]:
    """The problems of where `manifests` have their objects in the bucket (see verify_remote)."""
    problems: list[Problem] = []
    packs = s3.list_packs() if manifests else {}
    loose: set[bytes] | None = None
    indexes: dict[str, dict[bytes, tuple[str, int, int]] | str] = {}
    for manifest in manifests:
        try:
            data = s3.get_map(manifest_address(manifest))
            where = {} if data is None else parse_map(data, manifest)
        except (CorruptBlock, FormatError) as exc:
            problems.append(Problem(manifest.name, "remote_map", None, f"{exc}: push the entry again"))
            continue
        for ref in manifest.objects:
            loc = where.get(ref.key)
            if loc is None or loc.pack is None:
                loose = set(s3.list_object_keys()) if loose is None else loose
                if ref.key not in loose:
                    problems.append(Problem(manifest.name, "remote_missing", ref.key, "the object is not in the "
                                            "bucket: push the entry again from a machine that has it"))
                continue
            if loc.pack not in packs:
                problems.append(Problem(manifest.name, "remote_missing", ref.key, f"its pack {loc.pack[:12]} is not in "
                                        "the bucket: push the entry again from a machine that has it"))
                continue
            index = indexes.get(loc.pack)
            if index is None:
                index = indexes[loc.pack] = _pack_index(s3, loc.pack, packs[loc.pack][0])
            if isinstance(index, str):
                problems.append(Problem(manifest.name, "remote_pack", ref.key, index))
            elif index.get(ref.key) != (ref.sha256, loc.offset, loc.length):
                problems.append(Problem(manifest.name, "remote_pack", ref.key, f"pack {loc.pack[:12]}'s index does not "
                                        "list the object where the entry's map places it: push the entry again"))
    return problems


def _pack_index(s3: S3Tier, pack: str, size: int) -> dict[bytes, tuple[str, int, int]] | str:
    """{key: (sha256, offset, length)} from the index at the end of `pack`, or why it cannot be read."""
    try:
        tail = s3.get_tail(pack, min(size, PACK_TAIL))
        need = None if tail is None else trailer_length(tail)
        if tail is not None and need is not None and len(tail) < need <= size:  # a large index
            tail = s3.get_tail(pack, need)
        if tail is None:
            return f"pack {pack[:12]} was removed meanwhile"
        members = parse_trailer(tail, pack, lambda blob: s3.open_index(pack, blob))
        return {key: (sha, offset, length) for key, sha, offset, length in members}
    except (FormatError, TqstoreError, ValueError) as exc:
        return f"pack {pack[:12]} is damaged ({exc}): push the entries using it again"


def _unreadable_reason(tiers: TierSet, name: str) -> str:
    try:
        tiers.local_manifest(name)
    except FormatError as exc:
        return f"the manifest cannot be read: {exc}"
    return "the manifest cannot be read"  # replaced meanwhile


def _check_object(tiers: TierSet, entry: str, want: Want, sha256: str) -> tuple[list[Problem], HotObject | None]:
    """The problems of one object of `entry`, and the object decoded when it is sound."""
    try:
        payload = tiers.lmdb.get_object(want.key)
    except CorruptBlock as exc:
        return [Problem(entry, "corrupt", want.key, str(exc))], None
    if payload is None:
        return [Problem(entry, "missing", want.key, f"the {want.kind} is not in the store")], None
    problems = []
    info = tiers.lmdb.object_info(want.key)
    if info is not None and info.sha256 != sha256:
        problems.append(Problem(entry, "digest", want.key, f"the stored {want.kind} is not the copy the entry "
                                                           f"recorded (sha256 {info.sha256[:12]}, not {sha256[:12]})"))
    try:
        return problems, decode(payload, want)
    except ConflictError as exc:
        problems.append(Problem(entry, "other_save", want.key, str(exc)))
    except BAD_CONTENT as exc:
        quarantine_lmdb(tiers.lmdb, want.key, f"{type(exc).__name__}: {exc}")
        problems.append(Problem(entry, "content", want.key, f"{exc} (quarantined)"))
    return problems, None


def _keys(manifest: Manifest) -> list[bytes]:
    return list(dict.fromkeys(r.key for r in manifest.objects))


def _delete(tiers: TierSet, keys: Iterable[bytes]) -> tuple[int, int]:
    """Delete LMDB objects; returns how many existed and their payload bytes."""
    infos = [info for info in map(tiers.lmdb.object_info, keys) if info is not None]
    tiers.lmdb.delete_objects(info.key for info in infos)
    return len(infos), sum(info.size for info in infos)


def _unreadable_note(names: list[str], where: str) -> str:
    return (f"manifests {', '.join(names)} in {where} cannot be read (damaged, sealed with another key, or "
            "written by a newer tqstore), so no unreferenced objects were removed: fix or remove them "
            "(tqstore verify, tqstore rm)")
