"""Storing a snapshot as a named entry: its objects are encoded here and published by
publish.py (missing objects first, the manifest last).

An object already stored under a key is never rewritten; the entry then uses the stored copy,
and `put` returns the snapshot joined from what is stored, so the caller continues from exactly
those bytes. Block 0's key does not cover its calibration, so a stored block 0 calibrated
differently cannot be combined with this snapshot's later blocks: that is a ConflictError (the
engine restores the longest stored prefix before prefilling, so only callers that bypass it
meet it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

from turboquant import parse_scheme
from turboquant.records import Snapshot

from tqstore.errors import ConflictError, TokenMismatch
from tqstore.format.blocks import (SplitSnapshot, block_keys, calibration_digest, join_blocks, join_resident,
                                   split_snapshot)
from tqstore.format.header import Provenance
from tqstore.format.manifest import Manifest, ObjectRef, window_key
from tqstore.format.objects import Parsed, build as build_object, build_run, dumps_objects
from tqstore.models.identity import CodecIdentity, ModelIdentity, codecs_digest
from tqstore.names import validate_name
from tqstore.store.publish import Batch, Digests, publish
from tqstore.store.tiers.lmdb import payload_sha256
from tqstore.store.tiers.memory import HotObject, decoded_nbytes
from tqstore.store.tierset import TierSet
from tqstore.store.object_checks import Want
from tqstore.units import MAX_DURATION

_BATCH_BYTES = 64 << 20  # payloads held at once while writing (LMDB commits about this much per transaction)
_HASH_THREADS = min(4, os.cpu_count() or 1)  # payload hashes at once, beside the encoding


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
    _check_scheme(snapshot, codec)
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
    source = _Encoder(tiers, wants, ours, bs)

    def build(digests: Digests, old: Manifest | None) -> Manifest:
        refs = [ObjectRef(w.key, *digests[w.key]) for w in wants]
        return Manifest(
            name=name, model_identity=model, model_digest=md, codec_digest=cd, scheme=codec.scheme, tokens=tokens,
            block_size=bs, blocks=tuple(refs[:-2]), shared=refs[-1], window=refs[-2],
            calibration=cal, sliding=not split.reusable_as_prefix, created=time.time(),
            prefill_seconds=float(prefill_seconds), model_ref=model_ref, adapter_path=adapter_path,
            pinned=pin or (old is not None and old.pinned),
            expires=None if ttl is None else time.time() + ttl, metadata=metadata,
            remote_etag=old.remote_etag if old is not None else None,
        )

    published = publish(tiers, name, wants, source, build)
    canonical = [(w.key, source.canonical[w.key], "put") for w in wants]
    result, kept = join_resident(SplitSnapshot([h.obj for _, h, _ in canonical[:-2]], canonical[-2][1].obj,
                                               canonical[-1][1].obj, bs))
    mx.eval(*result.arrays())
    tiers.keep_joined(canonical[:-2], kept, canonical[-2:])  # the next restore is a slice of `result`
    new_blocks = sum(1 for w in wants[:-2] if w.key in published.written)
    return PutResult(name, result, published.manifest, new_blocks, len(keys) - new_blocks,
                     sum(published.written.values()), published.evicted, published.warnings)


class _Encoder:
    """The snapshot's objects as a publish source. The canonical copy of each object is the
    stored one if any, else a verified memory copy (e.g. fetched from S3 but not kept in LMDB),
    else ours; `canonical` holds them (with their digests) once the publish has written."""

    action = "save"
    advice = ("its later blocks cannot be combined with this snapshot: restore the stored prefix first (lookup + "
              "restore) and continue from it")

    def __init__(self, tiers: TierSet, wants: list[Want], ours: list[HotObject], block_size: int) -> None:
        self.wants, self.ours, self.block_size = wants, ours, block_size
        self.memory = {}
        for want in wants:
            hot = tiers.memory.get(want.key)
            if hot is not None and want.problem(hot.kind, hot.provenance) is None \
                    and want.other_save(hot.kind, hot.provenance) is None:
                self.memory[want.key] = hot
        self.canonical: dict[bytes, HotObject] = {}
        self.parsed: dict[bytes, Parsed] = {}  # the objects written, as their bytes decode

    def expected(self, want: Want) -> str | None:
        """A verified memory copy's digest: an LMDB copy with it is not read again."""
        hot = self.memory.get(want.key)
        return hot.sha256 if hot is not None else None

    def payloads(self, missing: list[Want], kept: Mapping[bytes, HotObject | None]) -> Iterator[Batch]:
        """Encode the missing objects after checking that every canonical copy joins."""
        canonical = {w.key: (kept[w.key] or self.memory[w.key]) if w.key in kept else self.memory.get(w.key, mine)
                     for w, mine in zip(self.wants, self.ours)}
        objs = [canonical[w.key].obj for w in self.wants]
        if any(canonical[w.key] is not mine for w, mine in zip(self.wants, self.ours)):
            # Our own split joins by construction; a stored or memory copy may not.
            try:
                join_blocks(SplitSnapshot(objs[:-2], objs[-2], objs[-1], self.block_size))
            except ValueError as exc:
                raise ConflictError(f"the stored objects this entry shares with an earlier save do not fit this "
                                    f"snapshot ({exc}): restore the stored prefix first and continue from it") from None
        self.canonical, self.parsed = canonical, {}
        # Each payload's sha256 (the digest its manifest records) is computed on threads while
        # the next objects are encoded here (hashlib releases the GIL): one thread took 1.3-1.8 s
        # of a 64k raw entry's 3.0-4.2 s put on the H200 (1.6 GB).
        with ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="tqstore-put-hash") as hasher:
            for chunk in _chunks(missing, [canonical[w.key].nbytes for w in missing]):
                hots = [canonical[w.key] for w in chunk]
                pending: dict[bytes, tuple[tuple[memoryview, ...], Future]] = {}
                for k, parts, parsed in dumps_objects([h.obj for h in hots], [h.provenance for h in hots]):
                    self.parsed[chunk[k].key] = parsed
                    pending[chunk[k].key] = (parts, hasher.submit(lambda p: payload_sha256(p).hex(), parts))
                yield self._hashed({w.key: pending[w.key] for w in chunk})
        # resumed once the last batch is handed to the writer: the written objects are built
        # while it commits
        self.build_written()

    def build_written(self) -> None:
        """The objects written, as a restore decodes them, for the memory tier and the join: the
        blocks built together (`build_run`: each name's groups copied once into one joined
        array, so the join that follows is a slice), any other object on its own."""
        keys = [w.key for w in self.wants if w.key in self.parsed]
        blocks = [k for k in keys if self.parsed[k].header.kind == "block"]
        built = dict(zip(blocks, build_run([self.parsed[k] for k in blocks]) or ()))
        for key in keys:
            obj = built[key] if key in built else build_object(self.parsed[key])[1]
            self.canonical[key] = dataclasses.replace(self.canonical[key], obj=obj)
        self.parsed = {}

    def _hashed(self, pending: dict[bytes, tuple[tuple[memoryview, ...], Future]]) -> Batch:
        batch: Batch = {}
        for key, (payload, digest) in pending.items():
            batch[key] = (payload, digest.result())
            self.canonical[key] = dataclasses.replace(self.canonical[key], sha256=batch[key][1])
        return batch


def _chunks(wants: list[Want], nbytes: list[int]) -> Iterator[list[Want]]:
    """Consecutive wants of about `_BATCH_BYTES` decoded bytes each: encoded together, written
    while the next chunk is encoded."""
    chunk, held = [], 0
    for want, n in zip(wants, nbytes):
        chunk.append(want)
        held += n
        if held >= _BATCH_BYTES:
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


def _hot(obj: object, kind: str, provenance: Provenance = Provenance()) -> HotObject:
    return HotObject(obj, kind, provenance, "", decoded_nbytes(obj))


def _check_scheme(snapshot: Snapshot, codec: CodecIdentity) -> None:
    """ValueError when the snapshot's compressed layers name another scheme than `codec`: the
    entry was written and only refused at its first restore (verify's codec check)."""
    scheme = parse_scheme(codec.scheme).name
    used = {parse_scheme(str(r.config["scheme"])).name for r in snapshot.layers if "scheme" in r.config}
    if used and used != {scheme}:
        raise ValueError(f"the snapshot's layers were encoded with {', '.join(sorted(used))}, but the codec identity "
                         f"given says {scheme}: pass CodecIdentity.from_snapshot(snapshot, scheme) of that scheme")


def _check_options(prefill_seconds: float, ttl: float | None, metadata: Mapping[str, str] | None) -> dict[str, str]:
    if not (isinstance(prefill_seconds, (int, float)) and math.isfinite(prefill_seconds) and prefill_seconds >= 0):
        raise ValueError(f"prefill_seconds must be a non-negative number, got {prefill_seconds!r}")
    if ttl is not None and not (isinstance(ttl, (int, float)) and 0 < ttl <= MAX_DURATION):
        raise ValueError(f"ttl must be a positive number of seconds up to 100 years, got {ttl!r}")
    metadata = dict(metadata or {})
    bad = next((k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"metadata maps strings to strings; {bad!r} does not")
    return metadata
