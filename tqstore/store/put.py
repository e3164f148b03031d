"""Storing a snapshot as a named entry: missing objects first, the manifest last.

An object already stored under a key is never rewritten; the entry then uses the stored copy,
and `put` returns the snapshot joined from what is stored, so the caller continues from exactly
those bytes. Block 0's key does not cover its calibration, so a stored block 0 calibrated
differently cannot be combined with this snapshot's later blocks: that is a ConflictError (the
engine restores the longest stored prefix before prefilling, so only callers that bypass it
meet it).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from turboquant.records import Snapshot

from tqstore.format.header import Provenance
from tqstore.format.objects import dumps as dump_object
from tqstore.format.blocks import SplitSnapshot, block_keys, calibration_digest, join_blocks, split_snapshot
from tqstore.errors import ConflictError, CorruptBlock, FormatError, TokenMismatch
from tqstore.store.verify import BAD_CONTENT, Want, decode, quarantine_lmdb
from tqstore.models.identity import CodecIdentity, ModelIdentity, codecs_digest
from tqstore.store.maintenance import enforce_budget
from tqstore.format.manifest import Manifest, ObjectRef, window_key
from tqstore.names import validate_name
from tqstore.store.tiers.memory import HotObject, decoded_nbytes
from tqstore.store.tierset import TierSet

_BATCH_BYTES = 64 << 20  # payloads held at once while writing (LMDB commits about this much per transaction)
_ATTEMPTS = 3


@dataclass(frozen=True)
class PutResult:
    """What `put` stored: the canonical snapshot (joined from the stored objects), the manifest,
    block counts, bytes written, and the entries the LMDB budget evicted afterwards."""

    name: str
    snapshot: Snapshot
    manifest: Manifest
    new_blocks: int
    reused_blocks: int
    bytes_written: int
    evicted: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def put_entry(tiers: TierSet, name: str, snapshot: Snapshot, tokens: Sequence[int], *, model: ModelIdentity,
              codec: CodecIdentity, model_ref: str, prefill_seconds: float, adapter_path: str | None = None,
              pin: bool = False, ttl: float | None = None, metadata: Mapping[str, str] | None = None) -> PutResult:
    """Store `snapshot` (prefilled with `tokens`) as entry `name`; see Store.put."""
    validate_name(name)
    tokens = tuple(int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens))
    if len(tokens) != snapshot.offset:
        raise TokenMismatch(f"{len(tokens)} tokens were given for a snapshot holding {snapshot.offset}: pass exactly "
                            "the tokens the cache was prefilled with")
    metadata = _check_options(prefill_seconds, ttl, metadata)
    md, cd, bs = model.digest, codec.digest, tiers.block_size
    split = split_snapshot(snapshot, bs)
    cal = calibration_digest(snapshot)
    keys = block_keys(tokens, md, cd, cal, bs)
    last = keys[-1] if keys else None
    wants = [Want(k.raw, "block", md, cd, tokens[b.start:b.start + b.n_tokens], k, cal)
             for k, b in zip(keys, split.blocks)]
    wants += [Want(window_key(last, md, cd), "window", md, cd, None, last, cal),
              Want(codecs_digest(snapshot.codecs), "shared", md, cd)]
    ours = [_hot(b, "block", Provenance(md, cd, cal, w.tokens, w.bound, keys[b.index - 1] if b.index else None))
            for b, w in zip(split.blocks, wants)]
    ours += [_hot(split.window, "window", Provenance(md, cd, cal, key=last)), _hot(split.shared, "shared")]
    written: dict[bytes, int] = {}  # payload bytes of the objects this put stored
    # A store already over its budget (lowered after a DiskFull, say) makes room first: on a full
    # disk the eviction that follows a put would otherwise never be reached.
    evicted, _ = enforce_budget(tiers, keep=name)
    with tiers.lock.shared():
        for _ in range(_ATTEMPTS):
            canonical, refs, complete = _store_objects(tiers, wants, ours, bs, written)
            if complete:
                break
        else:
            raise ConflictError(f"other processes kept storing different copies of the objects of {name}: retry")
        old = _old_manifest(tiers, name)
        manifest = Manifest(
            name=name, model_identity=model, model_digest=md, codec_digest=cd, scheme=codec.scheme, tokens=tokens,
            block_size=bs, blocks=tuple(refs[w.key] for w in wants[:-2]), shared=refs[wants[-1].key],
            window=refs[wants[-2].key], calibration=cal, sliding=not split.reusable_as_prefix, created=time.time(),
            prefill_seconds=float(prefill_seconds), model_ref=model_ref, adapter_path=adapter_path,
            pinned=pin or (old is not None and old.pinned),
            expires=None if ttl is None else time.time() + ttl, metadata=metadata,
            remote_etag=old.remote_etag if old is not None else None,
        )
        tiers.lmdb.put_manifest(name, manifest.to_bytes())
    if manifest.pinned:
        tiers.refresh_pins()
    else:
        tiers.ensure_pins()
    for want, hot in zip(wants, canonical):
        tiers.memory.put(want.key, hot)
    result = join_blocks(SplitSnapshot([h.obj for h in canonical[:-2]], canonical[-2].obj, canonical[-1].obj, bs))
    new_blocks = sum(1 for w in wants[:-2] if w.key in written)
    after, warnings = enforce_budget(tiers, keep=name)
    return PutResult(name, result, manifest, new_blocks, len(keys) - new_blocks, sum(written.values()),
                     tuple(evicted + after), tuple(warnings))


def _store_objects(tiers: TierSet, wants: list[Want], ours: list[HotObject], block_size: int,
                   written: dict[bytes, int]) -> tuple[list[HotObject], dict[bytes, ObjectRef], bool]:
    """Decide each object's canonical copy (stored if any, else ours), check they join, write the
    missing ones (adding their sizes to `written`). Returns (canonical copies, refs, complete);
    not complete when another process stored a different copy of one of them meanwhile: plan
    again, and the next plan finds that copy stored."""
    canonical, refs, missing = [], {}, []
    for want, mine in zip(wants, ours):
        stored = _stored_copy(tiers, want)
        if stored is None:
            memory = tiers.memory.get(want.key)  # e.g. fetched from S3 but not kept in LMDB
            usable = memory is not None and want.problem(memory.kind, memory.provenance) is None \
                and want.other_save(memory.kind, memory.provenance) is None
            canonical.append(memory if usable else mine)
            missing.append(len(canonical) - 1)
        else:
            canonical.append(stored[0])
            refs[want.key] = stored[1]
    try:
        join_blocks(SplitSnapshot([h.obj for h in canonical[:-2]], canonical[-2].obj, canonical[-1].obj, block_size))
    except ValueError as exc:
        raise ConflictError(f"the stored objects this entry shares with an earlier save do not fit this snapshot "
                            f"({exc}): restore the stored prefix first and continue from it") from None
    digests: dict[bytes, str] = {}
    batch: dict[bytes, bytes] = {}
    for i in missing:
        hot, key = canonical[i], wants[i].key
        payload = dump_object(hot.obj, hot.provenance)
        batch[key] = payload
        digests[key] = hashlib.sha256(payload).hexdigest()
        canonical[i] = HotObject(hot.obj, hot.kind, hot.provenance, digests[key], hot.nbytes)
        if sum(map(len, batch.values())) >= _BATCH_BYTES:
            tiers.lmdb.put_objects(batch, sha256s=digests)
            batch = {}
    tiers.lmdb.put_objects(batch, sha256s=digests)
    complete = True
    for key, digest in digests.items():
        info = tiers.lmdb.object_info(key)
        if info is None or info.sha256 != digest:
            complete = False  # another writer stored its copy first (existing keys are skipped)
            continue
        refs[key] = ObjectRef(key, info.sha256, info.size)
        written[key] = info.size
    return canonical, refs, complete


def _stored_copy(tiers: TierSet, want: Want) -> tuple[HotObject, ObjectRef] | None:
    """The verified LMDB copy of `want` (the memory copy when it is the same bytes), or None.

    A damaged copy is quarantined and counts as absent; a good copy of another save (block 0
    calibrated differently) is a ConflictError: it is right for the entries that use it.
    """
    info = tiers.lmdb.object_info(want.key)
    if info is None:
        return None
    ref = ObjectRef(want.key, info.sha256, info.size)
    hot = tiers.memory.get(want.key)
    if hot is not None and hot.sha256 == info.sha256 and want.problem(hot.kind, hot.provenance) is None:
        if want.other_save(hot.kind, hot.provenance) is None:
            return hot, ref
    try:
        found = tiers.lmdb.get_verified(want.key)
    except CorruptBlock:  # quarantined by the tier: store ours
        return None
    if found is None:
        return None
    try:
        return decode(found[0], want, found[1]), ref
    except ConflictError as exc:
        raise ConflictError(f"the store already holds the first block of these tokens from another save: {exc}. "
                            "Its later blocks cannot be combined with this snapshot: restore the stored prefix "
                            "first (lookup + restore) and continue from it") from None
    except BAD_CONTENT as exc:
        quarantine_lmdb(tiers.lmdb, want.key, f"{type(exc).__name__}: {exc}")
        return None


def _old_manifest(tiers: TierSet, name: str) -> Manifest | None:
    try:
        return tiers.local_manifest(name)
    except FormatError:
        return None  # a damaged manifest is simply replaced


def _hot(obj: object, kind: str, provenance: Provenance = Provenance()) -> HotObject:
    return HotObject(obj, kind, provenance, "", decoded_nbytes(obj))


def _check_options(prefill_seconds: float, ttl: float | None, metadata: Mapping[str, str] | None) -> dict[str, str]:
    if not (isinstance(prefill_seconds, (int, float)) and math.isfinite(prefill_seconds) and prefill_seconds >= 0):
        raise ValueError(f"prefill_seconds must be a non-negative number, got {prefill_seconds!r}")
    if ttl is not None and not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    metadata = dict(metadata or {})
    bad = next((k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"metadata maps strings to strings; {bad!r} does not")
    return metadata
