"""Damaged bytes in every tier: each trial is a clean miss with a reason, or an identical load.

One entry of a tiny random-weight llama (turbo4, 300 tokens: two blocks, the window and the
shared codecs) is stored. Each trial damages one of its objects at one position and loads
the entry again:

- position classes: every field of the 64-byte frame, the binary header, the digests written
  in the header, the padding before groups, each group's bytes, and random positions;
- operations: flip a byte, zero a run of bytes, truncate there, insert bytes there;
- where: LMDB bit rot (segments changed under the tier's own digest), LMDB rewritten (a bad
  payload stored with a matching digest, so the format reader must catch it), LMDB reframed
  (the frame's length and header digest recomputed too, so only the header's consistency and
  the group digests remain), and the bucket (bit rot, and a rewrite with matching metadata), restored
  through a remote lookup into an empty home.

A miss must name its reason and leave the damaged copy quarantined (LMDB) or marked gone
(bucket), never promoted to a faster tier. A load must be identical to the saved snapshot, bit
for bit, and greedy decoding from it must give exactly the cold run's logits: decoded for the
first whole load of each kind of trial (damage mode, memory substitute and its fate), since a
later load of that kind, bit-identical to the decoded one, decodes alike. The memory tier is
checked as the destination of promotions (above) and by substituting wrong decoded objects
under a key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import struct
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import pytest

from harness import open_store, s3_settings
from test_blocks import assert_same_snapshot
from test_store import decode_logits, stored_model_entry
from tqstore.format import objects as F
from tqstore.format import tables
from tqstore.format.blocks import join_blocks, split_snapshot
from tqstore.errors import CorruptBlock
from tqstore.store.tiers.lmdb_layout import delete_segments
from tqstore.store.tiers.memory import HotObject
from turboquant import restore

OPS = ("flip", "zero", "truncate", "extend")
LMDB_MODES = ("lmdb-rot", "lmdb-rewritten", "lmdb-reframed")
S3_MODES = ("s3-rot", "s3-rewritten")
_SEGMENT = struct.Struct(">I")


@dataclass
class Entry:
    """The stored entry, what it was made from, and the cold run's logits."""

    model: object
    prompt: mx.array
    snap: object
    tokens: list[int]
    model_id: object
    codec_id: object
    cold: list[mx.array]
    payloads: dict[bytes, bytes]  # every object's stored bytes
    kinds: dict[bytes, str]  # "block 0", "block 1", "window", "shared"


@pytest.fixture(scope="module")
def entry(tmp_path_factory) -> Entry:
    model, prompt, caches, snap, model_id, codec_id = stored_model_entry("turbo4", 300)
    cold = decode_logits(model, caches, prompt[-1:])
    home = tmp_path_factory.mktemp("corruption") / "origin"
    store = open_store(home)
    tokens = prompt[:-1].tolist()
    result = store.put("tiny", snap, tokens, model=model_id, codec=codec_id, model_ref="tiny", prefill_seconds=0.1)
    m = result.manifest
    kinds = {r.key: f"block {i}" for i, r in enumerate(m.blocks)} | {m.window.key: "window", m.shared.key: "shared"}
    payloads = {k: store._tiers.lmdb.get_object(k) for k in kinds}
    store.close()
    return Entry(model, prompt, snap, tokens, model_id, codec_id, cold, payloads, kinds)


# -- where to damage, and how ----------------------------------------------------------------


def position_classes(payload: bytes) -> dict[str, list[int]]:
    """Every byte position of an object (format 3), by what it holds."""
    (header_len,) = struct.unpack_from("<Q", payload, 16)
    start = F.FRAME_SIZE
    _, groups = tables.read_header(memoryview(payload)[start:start + header_len], len(payload) - start, len(payload))
    n_groups = len(groups.infos)
    counts = tables.HEAD.unpack_from(payload, start)
    n_tokens = 0 if counts[3] == tables.NONE else counts[3]
    group_table = start + tables.HEAD.size + 4 * n_tokens
    digests = {p for j in range(n_groups) for p in range(group_table + tables.GROUP.itemsize * j + 32,
                                                         group_table + tables.GROUP.itemsize * (j + 1))}
    classes = {"frame: magic": list(range(0, 8)), "frame: version": list(range(8, 12)),
               "frame: reserved": list(range(12, 16)), "frame: header length": list(range(16, 24)),
               "frame: payload length": list(range(24, 32)), "frame: digest": list(range(32, 64)),
               "digests in the header": sorted(digests),
               "binary header": [p for p in range(start, start + header_len) if p not in digests]}
    at = start + header_len
    for j, (offset, stored) in enumerate(zip(groups.offsets.tolist(), groups.stored.tolist())):
        if offset > at:
            classes.setdefault("padding", []).extend(range(at, offset))
        if stored:
            classes[f"tensor group/{j}"] = list(range(offset, offset + stored))
        at = offset + stored
    return classes


def damage(payload: bytes, op: str, pos: int, rng: random.Random) -> bytes:
    b = bytearray(payload)
    if op == "flip":
        b[pos] ^= rng.randrange(1, 256)
    elif op == "zero":
        n = rng.randrange(1, 17)
        b[pos:pos + n] = bytes(len(b[pos:pos + n]))
    elif op == "truncate":
        del b[pos:]
    else:
        b[pos:pos] = rng.randbytes(rng.randrange(1, 17))
    return bytes(b)


def reframe(data: bytes) -> bytes:
    """Recompute the frame's payload length and its digest of the header over damaged bytes
    (what a buggy writer would do), so that only the checks inside the object can catch the
    damage (the group digests, the padding, the header's own consistency)."""
    if len(data) < F.FRAME_SIZE:
        return data
    (header_len,) = struct.unpack_from("<Q", data, 16)
    head = data[F.FRAME_SIZE:F.FRAME_SIZE + header_len]
    return data[:24] + struct.pack("<Q", len(data) - F.FRAME_SIZE) + hashlib.sha256(head).digest() + \
        data[F.FRAME_SIZE:]


def positions(classes: dict[str, list[int]], per_class: int, rng: random.Random,
              tensors: int | None) -> list[tuple[str, int]]:
    """(class, position) pairs: `per_class` random positions per class (the first, middle and
    last ones too when per_class > 1), `tensors` tensor classes at most, and random positions
    over the whole object."""
    names = [c for c in classes if not c.startswith("tensor ")]
    tensor_names = [c for c in classes if c.startswith("tensor ")]
    names += tensor_names if tensors is None else rng.sample(tensor_names, min(tensors, len(tensor_names)))
    out = []
    for name in names:
        spots = classes[name]
        chosen = rng.sample(spots, min(per_class, len(spots)))
        if per_class > 1:
            chosen += [spots[0], spots[len(spots) // 2], spots[-1]]
        out += [(name, p) for p in dict.fromkeys(chosen)]
    size = max(max(spots) for spots in classes.values()) + 1
    out += [("random", rng.randrange(size)) for _ in range(per_class)]
    return out


# -- installing a damaged copy ---------------------------------------------------------------


def rot_segments(tier, key: bytes, data: bytes) -> None:
    """Replace the object's segments under its unchanged header (the tier's digest still
    describes the original: storage-level damage)."""
    per = tier.object_info(key).segment_size

    def job(txn):
        segments = tier._env.dbs[b"segments"]
        delete_segments(txn, segments, key)
        for i in range(-(-len(data) // per)):
            txn.put(key + _SEGMENT.pack(i), data[i * per:(i + 1) * per], db=segments)

    tier._env.write(job)


def replace_object(tier, key: bytes, data: bytes) -> None:
    if tier.has_object(key):  # a quarantined copy is gone already, and a delete is two synced commits
        tier.delete_objects([key])
    tier.put_objects({key: data})


def reason_of(quarantined: list, key: bytes, message: str) -> str:
    """The reason class of a miss: the quarantine record's leading word, else the message's."""
    record = next((r for r in quarantined if r.key == key), None)
    text = record.reason if record is not None else message
    return re.split(r"[:(]", text, maxsplit=1)[0].strip()[:40]


def check_load(entry: Entry, snap, n_tokens: int, kind: str, decoded: set[str]) -> None:
    """A successful load: the saved snapshot (or its first blocks), bit for bit. The first whole
    load of each `kind` also decodes like the cold run (`decoded` holds the kinds done): the
    others are bit-identical to it, and a greedy decode of 4 steps costs more than a load."""
    if n_tokens == len(entry.tokens):
        assert_same_snapshot(snap, entry.snap)
        if kind in decoded:
            return
        decoded.add(kind)
        got = decode_logits(entry.model, restore(snap), entry.prompt[-1:])
        assert all(mx.array_equal(a, b).item() for a, b in zip(entry.cold, got)), "greedy decode differs"
    else:
        assert_same_snapshot(snap, join_blocks(split_snapshot(entry.snap), n_tokens // 256))


# -- the trials ------------------------------------------------------------------------------


def lmdb_trials(entry: Entry, home, per_class: int, tensors: int | None, ledger, scenario: str,
                rng: random.Random) -> Counter:
    store = open_store(home)
    tier, memory = store._tiers.lmdb, store._tiers.memory
    outcomes: Counter = Counter()
    decoded: set[str] = set()
    try:
        store.put("tiny", entry.snap, entry.tokens, model=entry.model_id, codec=entry.codec_id, model_ref="tiny",
                  prefill_seconds=0.1)
        for key, original in entry.payloads.items():
            # Only bit rot needs the original stored (it damages the segments under the original's
            # index entry); a rewrite replaces whatever is there. So the original goes back when
            # rot or the next object needs it, not after every trial (each write is a synced commit).
            intact = True
            for cls, pos in positions(position_classes(original), per_class, rng, tensors):
                for op in OPS:
                    for mode in LMDB_MODES:
                        if mode == "lmdb-reframed" and cls in ("frame: payload length", "frame: digest"):
                            continue  # reframing rewrites exactly those bytes
                        bad = damage(original, op, pos, rng)
                        if mode == "lmdb-rot":
                            if not intact:
                                replace_object(tier, key, original)
                            rot_segments(tier, key, bad)
                        else:
                            replace_object(tier, key, reframe(bad) if mode == "lmdb-reframed" else bad)
                        intact = False
                        memory.drop([key])  # the read must reach LMDB
                        try:
                            snap, stats = store.load("tiny")
                        except CorruptBlock as exc:
                            assert key.hex()[:12] in str(exc), str(exc)
                            quarantined = tier.quarantined()
                            assert key in {r.key for r in quarantined}, f"{mode} {cls} {op}: not quarantined"
                            assert not memory.has(key), "a damaged copy was promoted to memory"
                            outcome = f"miss: {reason_of(quarantined, key, str(exc))}"
                        else:
                            check_load(entry, snap, stats.tokens, mode, decoded)
                            outcome = "identical load, same greedy decode"
                        outcomes[outcome] += 1
                        ledger.count(scenario, f"{mode}: {outcome}")
                        ledger.count(scenario, f"position class {_group(cls)}: trials")
                        tier.clear_quarantine()
            replace_object(tier, key, original)
        assert store.verify() == []
    finally:
        store.close()
    return outcomes


def s3_trials(entry: Entry, s3, tmp_path, per_class: int, tensors: int | None, ledger, scenario: str,
              rng: random.Random) -> Counter:
    origin = open_store(tmp_path / "s3-origin", **s3_settings(s3))
    origin.put("tiny", entry.snap, entry.tokens, model=entry.model_id, codec=entry.codec_id, model_ref="tiny",
               prefill_seconds=0.1)
    origin.push("tiny")
    origin.close()
    reader = open_store(tmp_path / "s3-reader", **s3_settings(s3))
    tiers = reader._tiers
    where = {key: s3.where(tiers.s3, "tiny", key) for key in entry.payloads}  # ranges of the entry's pack
    outcomes: Counter = Counter()
    decoded: set[str] = set()
    query = entry.tokens + [1]
    try:
        for key, original in entry.payloads.items():
            name, start, end = where[key]
            head = s3.client.head_object(Bucket=s3.bucket, Key=name)
            pack = s3.client.get_object(Bucket=s3.bucket, Key=name)["Body"].read()
            assert pack[start:end] == original
            pairs = positions(position_classes(original), per_class, rng, tensors)
            for i, (cls, pos) in enumerate(pairs):
                for op in (OPS if per_class > 1 else [OPS[i % len(OPS)]]):
                    # A pack member has no metadata of its own (its digest is the manifest's), so
                    # both modes put the same bytes: the damaged member in place of the good one.
                    mode = S3_MODES[(i // len(OPS) + OPS.index(op)) % len(S3_MODES)]
                    bad = damage(original, op, pos, rng)
                    s3.client.put_object(Bucket=s3.bucket, Key=name, Body=pack[:start] + bad + pack[end:],
                                         Metadata=head["Metadata"])
                    tiers.memory.drop([key])
                    tiers.lmdb.delete_objects([key])
                    tiers.remote.note_objects([key])  # believed in the bucket again
                    match = reader.lookup(query, model=entry.model_id.digest, codec=entry.codec_id.digest)
                    try:
                        snap, stats = reader.restore(match)
                    except CorruptBlock as exc:
                        assert key.hex()[:12] in str(exc), str(exc)
                        outcome = f"miss: {_s3_reason(str(exc))}"
                    else:
                        check_load(entry, snap, stats.tokens, mode, decoded)
                        if stats.tokens == len(entry.tokens):
                            outcome = "identical load, same greedy decode"
                        else:
                            assert any(key.hex()[:12] in m for m in stats.misses), stats.misses
                            outcome = "miss of the damaged block, shorter prefix restored identically"
                    if outcome.startswith("miss"):
                        assert not tiers.remote.has(key), "a damaged bucket object is still believed good"
                        assert not tiers.lmdb.has_object(key) and not tiers.memory.has(key), "damage was promoted"
                    outcomes[outcome] += 1
                    ledger.count(scenario, f"{mode}: {outcome}")
                    tiers.remote.note_objects(list(entry.payloads))  # a shifted member's neighbours failed too
            # Each trial puts the whole pack, made from its good bytes: they go back once, for the next object.
            s3.client.put_object(Bucket=s3.bucket, Key=name, Body=pack, Metadata=head["Metadata"])
    finally:
        reader.close()
    return outcomes


def _s3_reason(message: str) -> str:
    """The reason class of a miss from the bucket."""
    for needle, reason in (("failed verification", "sha256 of the bucket copy"),
                           ("failed authentication", "AES-GCM authentication"),
                           ("not in the bucket", "absent"), ("is unusable", "format check"),
                           ("shorter than its map says", "pack cut short (a shifted member)")):
        if needle in message:
            return reason
    return message[:40]


def _group(cls: str) -> str:
    return cls.split(":")[0] if cls.startswith("frame") else "tensor" if cls.startswith("tensor ") else cls


def memory_trials(entry: Entry, home, ledger, scenario: str) -> None:
    """Wrong decoded objects under a key in the memory tier (another object, another model's,
    other tokens'): each load is identical; every substitute that is not the right object is
    dropped with a reason and LMDB serves the right one."""
    store = open_store(home)
    memory = store._tiers.memory
    decoded: set[str] = set()
    try:
        store.put("tiny", entry.snap, entry.tokens, model=entry.model_id, codec=entry.codec_id, model_ref="tiny",
                  prefill_seconds=0.1)
        keys = list(entry.payloads)
        for key in keys:
            good = memory.get(key)
            substitutes = [("another object", memory.get(k)) for k in keys if k != key]
            substitutes += [(label, HotObject(good.obj, good.kind, _with(good.provenance, **change), good.sha256,
                                              good.nbytes))
                            for label, change in (("another model's provenance", {"model": bytes(32)}),
                                                  ("other tokens' provenance", {"tokens": (1, 2, 3)}))]
            for label, hot in substitutes:
                memory.put(key, hot)
                snap, stats = store.load("tiny")
                dropped = any("dropped" in m and key.hex()[:12] in m for m in stats.misses)
                assert dropped or hot.obj is good.obj, (label, stats.misses)
                kept = "kept (the right object; this kind's provenance does not carry that field)"
                outcome = f"memory: {label}: {'dropped, LMDB served identically' if dropped else kept}"
                check_load(entry, snap, stats.tokens, outcome, decoded)
                ledger.count(scenario, outcome)
                memory.put(key, good)
    finally:
        store.close()


def _with(prov: F.Provenance, **changes) -> F.Provenance:
    return dataclasses.replace(prov, **changes)


def test_corruption_every_tier_short(entry, tmp_path, s3, ledger):
    rng = random.Random("corruption")
    lmdb = lmdb_trials(entry, tmp_path / "lmdb", 1, 3, ledger, "corruption (short)", rng)
    bucket = s3_trials(entry, s3, tmp_path, 1, 2, ledger, "corruption (short)", rng)
    memory_trials(entry, tmp_path / "memory", ledger, "corruption (short)")
    ledger.count("corruption (short)", "trials", sum(lmdb.values()) + sum(bucket.values()))
    assert sum(lmdb.values()) > 500 and any(k.startswith("miss") for k in bucket)


@pytest.mark.reliability_long
def test_corruption_every_tier_long(entry, tmp_path, s3, ledger, trials):
    rng = random.Random("corruption-long")
    per_class = max(2, (trials or 200) // 50)  # random positions per class, besides the first, middle, last
    lmdb = lmdb_trials(entry, tmp_path / "lmdb", per_class, None, ledger, "corruption (long)", rng)
    bucket = s3_trials(entry, s3, tmp_path, per_class, 6, ledger, "corruption (long)", rng)
    memory_trials(entry, tmp_path / "memory", ledger, "corruption (long)")
    ledger.count("corruption (long)", "trials", sum(lmdb.values()) + sum(bucket.values()))
