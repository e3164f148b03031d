"""`tqstore repair`: bring a damaged store back to working, keeping everything that is sound.

Two kinds of damage, handled in order:
- data.mdb as a whole cannot be read safely by LMDB (truncated or empty:
  lmdb_env.check_data_file; pages of its B-trees damaged: lmdb_pages.damaged_pages). The LMDB
  folder is moved aside (never deleted: a backup tool may still get something out of it), a
  new one is started, and every entry that can still be read whole out of the old file, page
  by page, is copied into it (`salvage`); the others come back by `tqstore pull` or by saving
  them again.
- single records are damaged (lmdb_records.py, and manifests that do not parse or fail their
  own digest). Each is fixed or dropped on its own: a manifest under a key that is not a valid
  name is stored again under its own name when it parses and that name is free; damaged
  objects are quarantined (verify); then gc removes what no entry references any more.
Manifests written by a newer tqstore are kept: they are not damaged. A layout version newer than
this tqstore's is set back only when every record is of this layout (a damaged version record).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tqstore.config import Config
from tqstore.errors import ConflictError, FormatError, FormatVersionTooNew, StoreDamaged
from tqstore.store.maintenance import GcStats, gc, verify
from tqstore.format.manifest import Manifest
from tqstore.names import is_valid_name
from tqstore.store.tiers.lmdb import LmdbTier, reset_newer_schema
from tqstore.store.tiers.lmdb_env import check_data_file, lock_holder
from tqstore.store.tiers.lmdb_layout import HEADER
from tqstore.store.tiers.lmdb_pages import PageReader, damaged_pages
from tqstore.store.tiers.lmdb_records import key_label, used_time
from tqstore.store.tierset import TierSet, check_name

_LMDB_DAMAGE = ("bad_header", "missing_segment", "segment_length", "checksum")


@dataclass(frozen=True)
class RepairResult:
    """What `repair` did: where a damaged LMDB folder went, the records fixed or dropped (as
    "db key: what was wrong"), manifests stored again under their own names, the damaged
    objects quarantined, the gc that followed and the problems left."""

    moved_aside: str | None
    records: tuple[str, ...]
    rekeyed: tuple[str, ...]
    quarantined: int
    gc: GcStats
    remaining: tuple[str, ...]  # what verify still finds (objects lost: pull or save those entries again)
    salvaged: tuple[str, ...] = ()  # entries read whole out of the folder moved aside
    lost: tuple[str, ...] = ()  # entries it held that could not be read whole ("name: why")
    unread_pages: int = 0  # pages of the moved data.mdb that could not be read: entries there have no name


def move_aside_if_unreadable(config: Config) -> str | None:
    """Move the LMDB folder aside when data.mdb cannot be read safely (truncated, empty, damaged
    pages); where it went, or None. Call it before the store is opened. ConflictError while
    another process has it open and it is damaged."""
    path = Path(config.lmdb_path)
    fd = os.open(path / "lock.mdb", os.O_RDWR) if (path / "lock.mdb").exists() else None
    try:
        pid = None if fd is None else lock_holder(fd)
        try:
            check_data_file(path)
            # The pages are walked only when no other process writes them: a live writer's
            # half-written pages are not damage (and LMDB is reading that file fine meanwhile).
            if pid is not None or damaged_pages(path) == 0:
                return None
        except StoreDamaged:
            pass
        if pid is not None:
            raise ConflictError(f"process {pid} has the LMDB store at {path} open: stop it (e.g. `tqstore serve`) "
                                "and run `tqstore repair` again")
        target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(path, target)
    finally:
        if fd is not None:
            os.close(fd)
    return str(target)


def repair_records(tiers: TierSet, moved_aside: str | None = None, notes: Iterable[str] = ()) -> RepairResult:
    """Fix or drop every damaged record, quarantine damaged objects, then gc (see the module);
    `notes` are what was fixed before the store was opened."""
    lmdb = tiers.lmdb
    notes, rekeyed = list(notes), []
    with tiers.lock.exclusive():
        damaged = lmdb.damaged_records()
        for record in damaged:
            if record.db == "manifests":
                name = _own_name(lmdb.manifest_record(record.key))
                if name is not None and lmdb.get_manifest(name) is None:
                    lmdb.put_manifest(name, lmdb.manifest_record(record.key))
                    rekeyed.append(name)
        lmdb.fix_records(damaged)
        notes += [f"{r.db} {r.label}: {r.detail}" for r in damaged]
        entries, unreadable = tiers.local_manifests()
        for name in unreadable:
            try:
                tiers.local_manifest(name)
            except FormatVersionTooNew:
                continue  # another tqstore's, not damaged
            except FormatError as exc:
                lmdb.delete_manifest(name)
                notes.append(f"manifests {name}: dropped ({exc})")
    quarantined, orphans = 0, []
    for problem in verify(tiers, None):  # quarantines objects whose content is damaged
        if problem.kind == "content":
            quarantined += 1
        elif problem.entry is None and problem.kind in _LMDB_DAMAGE and problem.key is not None:
            quarantined += lmdb.quarantine(problem.key, f"{problem.kind}: {problem.detail}")
        elif problem.kind == "orphan_segment" and problem.key is not None:
            orphans.append(problem.key)
    if lmdb.delete_orphan_segments(orphans):  # whatever their key's length: they are not objects
        notes += [f"segments {key.hex()}: segments without an index entry, removed" for key in orphans]
    stats = gc(tiers, remote=False, compact=False, remote_grace=0.0)
    remaining = tuple(f"{p.entry or '-'} {p.kind}: {p.detail}" for p in verify(tiers, None))
    return RepairResult(moved_aside, tuple(notes), tuple(rekeyed), quarantined, stats, remaining)


def repair_home(config: Config) -> RepairResult:
    """`repair` of the home of `config`, whose store must not be open in this process yet."""
    from tqstore.store.store import Store

    moved = move_aside_if_unreadable(config)
    schema = reset_newer_schema(config.lmdb_path)
    store = Store.open(config=config)
    try:
        notes = [schema] if schema else []
        salvaged, lost, unread = salvage(Path(moved), store.tiers, notes) if moved else ([], [], 0)
        result = repair_records(store.tiers, moved, notes)
        return dataclasses.replace(result, salvaged=tuple(salvaged), lost=tuple(lost), unread_pages=unread)
    finally:
        store.close()


def salvage(folder: Path, tiers: TierSet, notes: list[str]) -> tuple[list[str], list[str], int]:
    """Copy every entry of the damaged LMDB folder `folder` that can still be read whole into the
    (new) store of `tiers`: its manifest parses and every object it names is there, each segment
    present and of its length, and the payload hashes to the digest its header and the manifest
    record. Returns the names kept, "name: why" for those lost (an entry whose manifest page is
    lost is named by its last-used record when that survived) and how many pages could not be
    read (entries whose manifests and last-used records were there cannot even be named), also
    noted in `notes`. The objects are checked in full (decoded against the manifest) by the
    verify that follows in `repair_records`."""
    reader = PageReader(folder / "data.mdb")
    kept, lost = [], []
    try:
        objects, segments = reader.records(b"objects"), reader.records(b"segments")
        used = reader.records(b"manifest_used")
        manifests = reader.records(b"manifests")
        # A truncated file keeps some trees and not others: an entry whose last-used time is
        # readable but whose manifest is not was lost, and saying nothing called that repaired.
        lost += [f"{key_label(key)}: its manifest was in a page that could not be read"
                 for key in sorted(set(used) - set(manifests))]
        with tiers.lock.exclusive():
            for key, value in sorted(manifests.items()):
                name = key_label(key)
                try:
                    data = reader.value(value)
                    manifest = check_name(Manifest.from_bytes(data or b""), name)
                except FormatError as exc:
                    lost.append(f"{name}: its manifest cannot be read ({exc})")
                    continue
                why = _copy_objects(reader, objects, segments, manifest, tiers.lmdb)
                if why is not None:
                    lost.append(f"{name}: {why}")
                    continue
                tiers.lmdb.put_manifest(name, data)
                when = used_time(used.get(key) if isinstance(used.get(key), bytes) else None)
                if when is not None:
                    tiers.lmdb.touch(name, when)
                kept.append(name)
        if reader.lost_pages:
            notes.append(f"data.mdb: {reader.lost_pages} damaged pages of {folder / 'data.mdb'} could not be read")
    finally:
        reader.close()
    return kept, lost, reader.lost_pages


def _copy_objects(reader: PageReader, objects: dict, segments: dict, manifest: Manifest, lmdb: LmdbTier) -> str | None:
    """Copy the objects of `manifest` that the new store lacks; why one cannot be read, or None."""
    for ref in {r.key: r for r in manifest.objects}.values():
        if lmdb.has_object(ref.key):
            continue
        header = reader.value(objects[ref.key]) if ref.key in objects else None
        if header is None or len(header) != HEADER.size or header[0] != 1:
            return f"object {ref.key.hex()[:12]}'s index entry is lost"
        _, digest, size, count, per_segment, _, _ = HEADER.unpack(header)
        parts = []
        for i in range(count):
            seg = ref.key + i.to_bytes(4, "big")
            part = reader.value(segments[seg]) if seg in segments else None
            expected = per_segment if i < count - 1 else size - per_segment * (count - 1)
            if part is None or len(part) != expected:
                return f"object {ref.key.hex()[:12]}'s segment {i} of {count} is lost"
            parts.append(part)
        payload = b"".join(parts)
        sha = hashlib.sha256(payload).hexdigest()
        if sha != digest.hex() or sha != ref.sha256:
            return f"object {ref.key.hex()[:12]} is damaged (sha256 {sha[:12]})"
        lmdb.put_objects({ref.key: payload}, {ref.key: sha})
    return None


def _own_name(data: bytes | None) -> str | None:
    """The name a stored manifest gives itself, if it parses whole."""
    try:
        manifest = Manifest.from_bytes(data or b"")
    except FormatError:
        return None
    return manifest.name if is_valid_name(manifest.name) else None
