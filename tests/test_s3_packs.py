"""The bucket's layout 2 (packs and maps, docs/format.md section 8) against a real S3 server
(moto, `s3` fixture) and real LMDB homes: buckets written in layout 1 still pull, restore, take
new entries and collect; verify --remote finds a lost pack, a damaged map and an index that
does not match; an encrypted bucket shares members across entries; a fetch answers for each
object wherever it lies."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections import Counter

import pytest

from test_blocks import assert_same_snapshot, make_snapshot
from test_store import MODEL, CODEC, PLAIN, put, token_ids
from test_store_s3 import bucket_keys, count_puts, put_sharing, s3_store
from tqstore.format.blocks import join_blocks, split_snapshot
from tqstore.store import crypto
from tqstore.errors import CorruptBlock
from tqstore.format.manifest import Manifest
from tqstore.store.bucket import fetch_objects
from tqstore.store.packs import Location, Member, manifest_address, plan_packs
from tqstore.store.object_checks import Want


def push_layout_1(store, name: str) -> None:
    """Push entry `name` as tqstore did before issue 28: one bucket object per stored object
    (the S3 tier's create-only `put_object`), then the manifest; no pack, no map."""
    tiers = store._tiers
    manifest = tiers.require_manifest(name)
    for ref in manifest.objects:
        payload, sha256 = tiers.lmdb.get_verified(ref.key)
        assert tiers.s3.put_object(ref.key, payload, sha256)
    tiers.s3.put_manifest(name, manifest.replace(pinned=False, remote_etag=None).to_bytes())


def test_a_layout_1_bucket_pulls_restores_takes_new_entries_and_collects(s3, tmp_path):
    old = s3_store(tmp_path / "old", s3)
    base = token_ids(900)
    snap_a = make_snapshot(900, layouts=PLAIN)
    put(old, "a", snap_a, base)
    push_layout_1(old, "a")
    assert len(bucket_keys(s3)) == len(old.get("a").objects) and not bucket_keys(s3, "kv/packs/")
    # A pull and a remote restore read the loose objects.
    b = s3_store(tmp_path / "b", s3)
    b.pull("a")
    assert_same_snapshot(b.load("a")[0], snap_a)
    c = s3_store(tmp_path / "c", s3)
    match = c.lookup(base[:600] + [1], model=MODEL.digest, codec=CODEC.digest)
    assert (match.tokens, match.tier) == (512, "s3")
    assert_same_snapshot(c.restore(match)[0], join_blocks(split_snapshot(snap_a), 2))
    # A new entry sharing a's first three blocks: only its own objects go up, in a pack; its map
    # points at a's loose objects for the shared ones.
    snap_b = make_snapshot(1000, layouts=PLAIN, seed=6)
    put(b, "b", snap_b, base[:768] + token_ids(232, seed=1))
    puts = count_puts(b)
    stats = b.push("b")
    shared = {r.key for r in b.get("a").objects} & {r.key for r in b.get("b").objects}
    assert len(shared) == 4 and stats.skipped == 4 and stats.transferred == len(b.get("b").objects) - 4
    assert (puts["objects"], puts["packs"], puts["maps"], puts["manifests"]) == (0, 1, 1, 1)
    assert c.verify(remote=True) == []
    d = s3_store(tmp_path / "d", s3)
    d.pull("b")
    b.close()  # b's memory tier holds the blocks its put encoded; LMDB kept a's copies of the shared ones
    b = s3_store(tmp_path / "b", s3)
    assert_same_snapshot(d.load("b")[0], b.load("b")[0])
    # gc: removing a leaves its loose objects that b uses; removing b too leaves nothing.
    old.rm("a", remote=True)
    old.gc(remote=True, remote_grace=0)
    assert bucket_keys(s3) == {old._tiers.s3.object_name(k) for k in shared}
    assert len(bucket_keys(s3, "kv/packs/")) == 1 and len(bucket_keys(s3, "kv/maps/")) == 1
    old.rm("b", remote=True)
    assert old.gc(remote=True, remote_grace=0).remote_orphans == 4 + 1  # the shared objects and b's pack
    assert not bucket_keys(s3, "kv/")
    for store in (old, b, c, d):
        store.close()


def test_verify_remote_names_a_lost_pack_a_damaged_map_and_a_wrong_index(s3, tmp_path):
    store = s3_store(tmp_path / "a", s3)
    put_sharing(store, 600, 700, 512)
    store.push()
    assert store.verify(remote=True) == []
    tier = store._tiers.s3
    a_manifest = store._tiers.remote_manifests(["a"])[0][0].manifest
    b_manifest = store._tiers.remote_manifests(["b"])[0][0].manifest
    (b_pack,) = bucket_keys(s3, "kv/packs/") - {s3.where(tier, "a", a_manifest.blocks[0].key)[0]}
    # b's own pack removed: b's members in it are missing, a is sound.
    body = s3.client.get_object(Bucket=s3.bucket, Key=b_pack)["Body"].read()
    s3.client.delete_object(Bucket=s3.bucket, Key=b_pack)
    problems = store.verify(remote=True)
    assert {p.entry for p in problems} == {"b"} and {p.kind for p in problems} == {"remote_missing"}
    assert {p.key for p in problems} == {r.key for r in b_manifest.objects} - {r.key for r in a_manifest.objects}
    # The pack back with another index (its last byte changed): every member of it is named.
    s3.client.put_object(Bucket=s3.bucket, Key=b_pack, Body=body[:-20] + bytes([body[-20] ^ 1]) + body[-19:])
    assert {(p.entry, p.kind) for p in store.verify(remote=True)} == {("b", "remote_pack")}
    s3.client.put_object(Bucket=s3.bucket, Key=b_pack, Body=body)
    assert store.verify(remote=True) == []
    # a's map damaged: named, and gc removes no pack while a map cannot be read.
    map_key = tier.map_name(manifest_address(a_manifest))
    head = s3.client.head_object(Bucket=s3.bucket, Key=map_key)
    data = s3.client.get_object(Bucket=s3.bucket, Key=map_key)["Body"].read()
    s3.client.put_object(Bucket=s3.bucket, Key=map_key, Body=data.replace(b'"version":1', b'"version":7'),
                         Metadata=head["Metadata"])
    assert [(p.entry, p.kind) for p in store.verify(remote=True)] == [("a", "remote_map")]
    store.rm("b", remote=True)
    stats = store.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and any("maps of entries a" in n for n in stats.notes)
    assert b_pack in bucket_keys(s3, "kv/packs/")
    store.close()


def test_an_encrypted_bucket_shares_members_and_names_nothing_readable(s3, tmp_path, monkeypatch):
    monkeypatch.setenv(crypto.KEY_ENV, base64.b64encode(bytes(range(32))).decode())
    store = s3_store(tmp_path / "a", s3)
    snaps = put_sharing(store, 1000, 1100, 768)
    store.push("a")
    stats = store.push("b")
    assert (stats.transferred, stats.skipped) == (3, 4)  # a's three blocks and the codecs are shared
    for key in bucket_keys(s3, "kv/"):
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        assert body.startswith(crypto.MAGIC) and b"tqstore" not in body, key
    assert store.verify(remote=True) == []
    reader = s3_store(tmp_path / "reader", s3)
    store.close()  # its memory tier holds what b's put encoded; LMDB kept a's copies of the shared blocks
    store = s3_store(tmp_path / "a", s3)
    for name in snaps:
        reader.pull(name)
        assert_same_snapshot(reader.load(name)[0], store.load(name)[0])
    puts = count_puts(store)
    assert store.push().up_to_date == ("a", "b") and sum(puts.values()) == 0  # nothing sent again
    store.close()
    reader.close()


@pytest.mark.parametrize("ordered", [True, False])
def test_fetch_answers_for_each_object_wherever_it_lies(s3, ordered):
    """bucket.fetch_objects: members of a pack (one ranged GET for neighbours), a loose object,
    an absent one and a damaged member, each answered once and on its own, in the order asked
    (or as each is checked: a pull's order)."""
    tier = s3.tier()
    payloads = {hashlib.sha256(b"%d" % i).digest(): os.urandom(1000 * (i + 1)) for i in range(4)}
    digests = {k: hashlib.sha256(p).hexdigest() for k, p in payloads.items()}
    keys = list(payloads)
    plan = plan_packs([Member(k, digests[k], len(payloads[k]), len(payloads[k])) for k in keys[:3]], None, 1 << 20)[0]
    body = bytearray(b"".join(payloads[k] for k in keys[:3]) + plan.trailer(plan.index))
    where = plan.locations()
    body[where[keys[1]].offset + 10] ^= 1  # the middle member damaged
    assert tier.put_pack(plan.name, bytes(body)) and not tier.put_pack(plan.name, bytes(body))
    assert tier.put_object(keys[3], payloads[keys[3]])
    absent = hashlib.sha256(b"absent").digest()
    located = [(Want(k, "block", b"", b"", sha256=digests[k]), where[k]) for k in keys[:3]]
    located += [(Want(keys[3], "block", b"", b"", sha256=digests[keys[3]]), Location(None)),
                (Want(absent, "block", b"", b"", sha256="0" * 64), Location(None))]
    gets = Counter()
    tier.client.meta.events.register("provide-client-params.s3.GetObject",
                                     lambda params, **_: gets.update([params["Key"].split("/")[1]]))
    got = [(want.key, result) for want, result in fetch_objects(tier, located, lambda w, payload: payload, ordered)]
    assert [k for k, _ in got] == keys + [absent] if ordered else sorted(k for k, _ in got) == sorted(keys + [absent])
    results = dict(got)
    assert results[keys[0]] == payloads[keys[0]] and results[keys[2]] == payloads[keys[2]]
    assert isinstance(results[keys[1]], CorruptBlock) and keys[1].hex() in str(results[keys[1]])
    assert results[keys[3]] == payloads[keys[3]] and results[absent] is None
    assert gets == {"packs": 1, "objects": 2}  # the three members in one ranged GET


def test_a_manifest_in_other_bytes_than_its_canonical_ones_still_finds_its_map(s3, tmp_path):
    """A pull starts the map's GET at the sha256 of the manifest's bytes as read, before parsing
    it; a manifest stored in other bytes (the same JSON spaced out, as an editor or another writer
    might leave it) names its map by its canonical bytes, and the pull fetches that one."""
    a = s3_store(tmp_path / "a", s3)
    snap = make_snapshot(300, layouts=PLAIN)
    put(a, "e", snap, token_ids(300))
    a.push("e")
    key = "kv/manifests/e.json"
    data = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    spaced = json.dumps(json.loads(data), indent=2).encode()
    assert spaced != data and manifest_address(Manifest.from_bytes(spaced)) == hashlib.sha256(data).hexdigest()
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=spaced,
                         Metadata={"tq-sha256": hashlib.sha256(spaced).hexdigest(), "tq-size": str(len(spaced))})
    b = s3_store(tmp_path / "b", s3)
    gets = Counter()
    b._tiers.s3.client.meta.events.register("provide-client-params.s3.GetObject",
                                            lambda params, **_: gets.update([params["Key"].split("/")[1]]))
    assert b.pull("e").transferred == len(a.get("e").objects)
    assert gets["maps"] == 2  # the guess (absent), then the map of the canonical bytes
    assert_same_snapshot(b.load("e")[0], snap)
    a.close()
    b.close()
