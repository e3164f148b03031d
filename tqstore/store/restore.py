"""Restoring an entry (or a block prefix of it): gather each object from the fastest tier with a
good copy, verify it, promote it, join, evaluate.

Tiers are tried memory -> LMDB -> S3. A copy that fails any check is a miss with a reason and
is quarantined where it lies (LMDB quarantines checksum failures itself; format and identity
failures are quarantined here; a damaged memory copy is dropped; a damaged or missing bucket
object is marked gone in the remote index, never deleted from the bucket, since one bad GET
may be the network's fault). The next tier is tried. Good copies are promoted (S3 -> LMDB ->
memory). Nothing is joined before every object needed is verified, and a restore returns the
whole requested prefix, a shorter prefix of whole blocks (block-prefix restores only), or raises.

The memory tier keeps the joined blocks as views of the joined arrays (`TierSet.keep_joined`), so a
restore from memory of what was last restored or saved (or of a prefix of it) is a slice of
arrays already in place: no decode, no copy, no transfer to the device.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import mlx.core as mx

from turboquant.records import Snapshot

from tqstore.errors import ConflictError, CorruptBlock, TqstoreError
from tqstore.format.blocks import SplitSnapshot, join_resident
from tqstore.format.manifest import Manifest
from tqstore.format.objects import Parsed, build as build_object, build_run
from tqstore.format.runs import Run
from tqstore.store.bucket import fetch_objects
from tqstore.store.lmdb_reads import LmdbReads, Placed, Read
from tqstore.store.packs import Location
from tqstore.store.tiers.memory import HotObject, decoded_nbytes
from tqstore.store.tierset import TierSet, slowest
from tqstore.store.object_checks import (BAD_CONTENT, Want, check_parsed, codec_problem, decode, decode_parsed,
                                  quarantine_lmdb, wants_for)

@dataclass(frozen=True)
class RestoreStats:
    """How a restore went: the slowest tier it read from, tokens and bytes restored, seconds
    (gathering, verification, join and mx.eval), and the misses it recovered from. `tokens` is the
    restored snapshot's length (its `offset`), which is shorter than the lookup's match when a
    block was lost in every tier: callers continue from `tokens`, never from the match."""

    tier: str
    tokens: int
    bytes: int
    seconds: float
    objects: dict[str, int] = field(default_factory=dict)  # objects served per tier
    misses: tuple[str, ...] = ()


@dataclass
class Gathered:
    """Verified objects by key with the tier each came from and its bytes, and the misses.
    Blocks read from LMDB are left parsed or placed, for `_build_blocks`."""

    objects: dict[bytes, tuple[HotObject, str, int]] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)
    run: Run | None = None  # the joined arrays LMDB blocks were decoded into (`Placed` objects)


def gather_objects(tiers: TierSet, wants: list[Want]) -> Gathered:
    """Every wanted object from the fastest tier holding a good copy, promoted to faster tiers."""
    out = Gathered()
    for want in wants:  # memory: already verified; check it is the object wanted here
        hot = tiers.memory.get(want.key)
        if hot is None:
            continue
        problem = want.problem(hot.kind, hot.provenance) or want.other_save(hot.kind, hot.provenance)
        if problem is None:
            out.objects[want.key] = (hot, "memory", hot.nbytes)
        else:
            tiers.memory.drop([want.key])
            out.misses.append(f"memory copy of {want.kind} {want.key.hex()[:12]} dropped: {problem}")
    pending = [w for w in wants if w.key not in out.objects]
    blocks = [w for w in wants if w.kind == "block"]
    reads = LmdbReads(tiers.lmdb, pending, len(blocks) if pending[:len(blocks)] == blocks else 0)
    for want, found in zip(pending, reads):
        _from_lmdb(tiers, want, found, out)
    out.run = reads.run
    pending = [w for w in pending if w.key not in out.objects]
    if pending and tiers.s3 is not None:
        _from_s3(tiers, pending, out)
    for hot, tier, _ in out.objects.values():
        tiers.counters.hit(tier)
    tiers.counters.miss(sum(1 for w in wants if w.key not in out.objects))
    return out


def _from_lmdb(tiers: TierSet, want: Want, found: Read, out: Gathered) -> None:
    what = f"{want.kind} {want.key.hex()[:12]}"
    if isinstance(found, CorruptBlock):  # the tier quarantined it
        out.misses.append(f"LMDB copy of {what}: {found}")
        return
    if found is None:
        return
    parsed, digest, nbytes = found
    try:
        if isinstance(parsed, TqstoreError):
            raise parsed
        if want.kind == "block" and (isinstance(parsed, Placed) or parsed.raws is not None):  # built with the others (_build_blocks)
            check_parsed(parsed, want)
            out.objects[want.key] = (HotObject(parsed, "block", parsed.header.provenance, digest, 0), "lmdb", nbytes)
        else:
            out.objects[want.key] = (decode_parsed(parsed, want, digest), "lmdb", nbytes)
    except ConflictError as exc:  # intact, and right for other entries: keep it
        out.misses.append(f"LMDB copy of {what}: {exc}")
    except BAD_CONTENT as exc:
        quarantine_lmdb(tiers.lmdb, want.key, f"{type(exc).__name__}: {exc}")
        out.misses.append(f"LMDB copy of {what} quarantined: {exc}")


def _from_s3(tiers: TierSet, wants: list[Want], out: Gathered) -> None:
    located = tiers.remote.locate([w.key for w in wants], {w.key: w.sha256 for w in wants if w.sha256})
    promoted = {}
    # A local entry's wants carry no digest: the bucket's copy is checked against the one its manifest records.
    items = [(dataclasses.replace(w, sha256=w.sha256 or located[w.key][0]), located[w.key][2]) if w.key in located
             else (w, Location(None)) for w in wants]
    for want, result in fetch_objects(tiers.s3, items, lambda w, payload: (decode(payload, w, w.sha256), payload)):
        what = f"{want.kind} {want.key.hex()[:12]}"  # errors are reported per object, on this thread
        if result is None or isinstance(result, TqstoreError):
            out.misses.append(f"S3 copy of {what}: {result or 'not in the bucket'}")
            if result is None or isinstance(result, (CorruptBlock, *BAD_CONTENT)):  # not when S3 was merely unreachable
                tiers.remote.gone(want.key)
            continue
        out.objects[want.key] = (result[0], "s3", len(result[1]))
        promoted[want.key] = result[1]
    try:
        tiers.lmdb.put_objects(promoted)
    except TqstoreError as exc:  # a full disk must not fail a restore whose objects are in hand
        out.misses.append(f"objects fetched from S3 were not kept in LMDB: {exc}")


def restore_entry(tiers: TierSet, manifest: Manifest, n_blocks: int, *, remote: bool,
                  allow_prefix: bool) -> tuple[Snapshot, RestoreStats]:
    """The snapshot of the first `n_blocks` blocks of `manifest` (all of them: the whole entry).

    A block that no tier holds in good shape shortens a block-prefix restore (`allow_prefix`, an
    entry without sliding-window layers) to the blocks before it; otherwise, or when nothing is
    left, or when the window or the shared codecs are lost, CorruptBlock names every miss.
    """
    start = time.perf_counter()
    wants = wants_for(manifest, n_blocks, remote)
    got = gather_objects(tiers, wants)
    lost = [w for w in wants if w.key not in got.objects]
    whole = n_blocks == len(manifest.blocks)
    if lost:
        first = min((i for i, w in enumerate(wants[:n_blocks]) if w.key not in got.objects), default=None)
        reusable = (allow_prefix and not manifest.sliding and first is not None and first > 0
                    and all(w.kind == "block" for w in lost))
        if not reusable:
            reasons = "; ".join(got.misses) or "no tier holds them"
            raise CorruptBlock(f"entry {manifest.name} cannot be restored: {len(lost)} of its objects are missing or "
                               f"damaged in every tier ({reasons}); save it again (or pull it again)")
        n_blocks, whole = first, False
    _build_blocks(got, wants, n_blocks)
    used = [got.objects[w.key] for w in wants if w.kind != "block"] + [got.objects[w.key] for w in wants[:n_blocks]]
    unfit = codec_problem(manifest, got.objects[wants[-2].key][0], got.objects[wants[-1].key][0])
    if unfit is not None:
        raise CorruptBlock(f"entry {manifest.name} cannot be restored: {unfit}. Run `tqstore verify`, then remove the "
                           "entry and save (or pull) it again")
    split = SplitSnapshot([got.objects[w.key][0].obj for w in wants[:n_blocks]], got.objects[wants[-2].key][0].obj,
                          got.objects[wants[-1].key][0].obj, manifest.block_size)
    try:
        snapshot, kept = join_resident(split, n_blocks)
    except ValueError as exc:
        suspects = _misfit(tiers, [(w, got.objects[w.key][0]) for w in wants if w.key in got.objects])
        why = "; ".join(f"{w.kind} {w.key.hex()[:12]} is not the copy any entry recorded (quarantined: it will be "
                        "fetched or recomputed again)" for w in suspects) or "they come from different saves"
        raise CorruptBlock(f"the stored objects of entry {manifest.name} do not fit together ({exc}): {why}; remove "
                           "the entry and save it again if this repeats") from None
    mx.eval(*snapshot.arrays())
    tokens = len(manifest.tokens) if whole else n_blocks * manifest.block_size
    if snapshot.offset != tokens:  # the caller prefills from here: the joined length must be it
        raise CorruptBlock(f"the stored objects of entry {manifest.name} hold {snapshot.offset} tokens where "
                           f"{tokens} were restored: remove the entry and save it again")
    fetched = [(w.key, *got.objects[w.key][:2]) for w in wants if w.key in got.objects]
    tiers.keep_joined(fetched[:n_blocks], kept, fetched[n_blocks:])
    per_tier: dict[str, int] = {}
    for _, tier, _ in used:
        per_tier[tier] = per_tier.get(tier, 0) + 1
    stats = RestoreStats(slowest(list(per_tier)), tokens, sum(n for _, _, n in used), time.perf_counter() - start,
                         per_tier, tuple(got.misses))
    return snapshot, stats


def _build_blocks(got: Gathered, wants: list[Want], n_blocks: int) -> None:
    """Build the blocks read from LMDB, which `_from_lmdb` checked but left placed or parsed:
    the placed ones as views of the run they were decoded into; those parsed of the first
    `n_blocks` together, each name's groups decoded straight into one joined array
    (`build_run`: one copy of each byte, and the join a slice of it); any others one by one."""
    left = [w for w in wants if w.key in got.objects and isinstance(got.objects[w.key][0].obj, Parsed | Placed)]
    placed = [w for w in left if isinstance(got.objects[w.key][0].obj, Placed)]
    built = {}
    if placed:
        items = [(p.index, p.header, p.raws) for p in (got.objects[w.key][0].obj for w in placed)]
        built = dict(zip((w.key for w in placed), got.run.blocks(items)))
    first = {w.key for w in wants[:n_blocks]}
    run = [w for w in left if w.key in first and w.key not in built]
    built.update(zip((w.key for w in run), build_run([got.objects[w.key][0].obj for w in run]) or ()))
    for want in left:
        hot, tier, nbytes = got.objects[want.key]
        block = built.get(want.key) or build_object(hot.obj)[1]
        got.objects[want.key] = (dataclasses.replace(hot, obj=block, nbytes=decoded_nbytes(block)), tier, nbytes)


def _misfit(tiers: TierSet, used: list[tuple[Want, HotObject]]) -> list[Want]:
    """After objects that each verified failed to join: forget them in memory (the next restore
    reads them again) and quarantine the LMDB copies whose digest no local entry recorded, which
    were stored by no put or pull of this store (a rewritten object can pass every check of its
    own and still not be the entry's). Returns the quarantined ones."""
    tiers.memory.drop([w.key for w, _ in used])
    recorded: dict[bytes, set[str]] = {}
    for m, _ in tiers.local_manifests()[0]:
        for ref in m.objects:
            recorded.setdefault(ref.key, set()).add(ref.sha256)
    suspects = []
    for want, hot in used:
        info = tiers.lmdb.object_info(want.key)
        if info is not None and info.sha256 == hot.sha256 and info.sha256 not in recorded.get(want.key, ()):
            quarantine_lmdb(tiers.lmdb, want.key, f"misfit: the {want.kind} does not fit its entry and is not the "
                                                  "copy any entry recorded")
            suspects.append(want)
    return suspects
