"""The Store with the S3 tier, against a real S3 HTTP server (moto, `s3` fixture): push, pull
into a second empty home, dedup, conditional-write conflicts, a server going down mid-push,
damaged bucket objects, lookups of what only the bucket holds, remote ls/rm/gc."""

from __future__ import annotations

import socket
import time
from collections import Counter

import mlx.core as mx
import pytest
from moto.server import ThreadedMotoServer

from lmdb_damage import flip_segment_byte
from test_blocks import assert_same_snapshot, make_snapshot
from test_store import CODEC, MODEL, PLAIN, decode_logits, open_store, put, stored_model_entry, token_ids
from tqstore.format.blocks import join_blocks, split_snapshot
from tqstore.format.manifest import Manifest
from tqstore.store import transfer
from tqstore.store.packs import manifest_address, parse_map
from tqstore.errors import ConflictError, CorruptBlock, NotFound, RemoteNotConfigured, RemoteUnreachable
from turboquant import restore
from turboquant.records import Layout


def s3_store(home, s3, endpoint=None, **settings):
    """A Store on `home` whose S3 tier is the test bucket (fast retries)."""
    settings = {"s3_url": f"s3://{s3.bucket}/kv", "s3_endpoint": endpoint or s3.endpoint, "s3_region": "us-east-1",
                "s3_max_attempts": 2, "s3_connect_timeout": 2, "s3_read_timeout": 10, **settings}
    return open_store(home, **settings)


def count_puts(store) -> Counter:
    """Counts uploads of the store's S3 client by folder ("objects", "packs", "maps",
    "manifests"; a multipart upload counts once), by bucket key, and their bytes by folder
    ("bytes packs", ...). Lock objects are not counted: every push writes one (bucket_locks.py)."""
    seen: Counter = Counter()

    def on_put(params, **_):
        if params["Key"].split("/")[1] != "locks":
            seen[params["Key"].split("/")[1]] += 1
            seen[params["Key"]] += 1

    def on_body(params, **_):
        if params["Key"].split("/")[1] != "locks":
            seen["bytes " + params["Key"].split("/")[1]] += len(params["Body"])

    events = store._tiers.s3.client.meta.events
    for operation in ("PutObject", "CreateMultipartUpload"):
        events.register(f"provide-client-params.s3.{operation}", on_put)
    for operation in ("PutObject", "UploadPart"):
        events.register(f"provide-client-params.s3.{operation}", on_body)
    return seen


def put_sharing(store, a: int, b: int, shared: int) -> dict[str, object]:
    """Entries "a" (`a` tokens) and "b" (`b` tokens) whose first `shared` tokens are the same;
    returns their snapshots."""
    base = token_ids(a)
    snaps = {"a": make_snapshot(a, layouts=PLAIN), "b": make_snapshot(b, layouts=PLAIN, seed=6)}
    put(store, "a", snaps["a"], base)
    put(store, "b", snaps["b"], base[:shared] + token_ids(b - shared, seed=1))
    return snaps


def bucket_keys(s3, folder: str = "kv/objects/") -> set[str]:
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=folder)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def test_push_pull_into_an_empty_home_and_decode(s3, tmp_path):
    model, prompt, caches, snap, model_id, codec_id = stored_model_entry("turbo4", 300)
    tokens = prompt[:-1].tolist()
    a = s3_store(tmp_path / "a", s3)
    a.put("tiny", snap, tokens, model=model_id, codec=codec_id, model_ref="tiny-llama", prefill_seconds=0.1)
    progress = []
    pushed = a.push("tiny", progress=lambda *p: progress.append(p))
    assert (pushed.entries, pushed.transferred, pushed.skipped) == (("tiny",), 4, 0)  # 2 blocks, window, codecs
    assert progress[-1][:2] == (4, 4) and pushed.bytes == a.get("tiny").nbytes
    assert [e.name for e in a.ls(remote=True)] == ["tiny"] and a.info("tiny", remote=True).tokens == 300
    b = s3_store(tmp_path / "b", s3)
    assert b.ls() == []
    pulled = b.pull("tiny")
    assert (pulled.transferred, pulled.bytes) == (4, pushed.bytes)
    assert b.get("tiny").same_content(a.get("tiny")) and b.verify() == []
    match = b.lookup(tokens + [1], model=model_id.digest, codec=codec_id.digest)
    assert (match.tokens, match.entry, match.tier, match.remote) == (300, "tiny", "lmdb", False)
    restored, stats = b.restore(match)
    assert stats.tier == "lmdb" and stats.tokens == 300
    expected = decode_logits(model, caches, prompt[-1:])  # the original, never-stored caches
    for x, y in zip(expected, decode_logits(model, restore(restored), prompt[-1:])):
        assert mx.array_equal(x, y).item()
    assert b.push("tiny").up_to_date == ("tiny",)  # the same entry: nothing to write
    a.close()
    b.close()


def test_a_second_entry_sharing_a_prefix_uploads_only_its_new_blocks(s3, tmp_path):
    store = s3_store(tmp_path / "a", s3)
    put_sharing(store, 1000, 1100, 768)
    puts = count_puts(store)
    a = store.push("a")
    assert a.transferred == 6 and a.bytes == store.get("a").nbytes
    # One pack for the six objects, its map, the manifest.
    assert (puts["objects"], puts["packs"], puts["maps"], puts["manifests"]) == (0, 1, 1, 1)
    puts.clear()
    stats = store.push("b")
    # b: 5 blocks of which 3 are a's, its window, the same codecs: two blocks and a window go up.
    assert (stats.transferred, stats.skipped) == (3, 4)
    assert (puts["objects"], puts["packs"], puts["maps"], puts["manifests"]) == (0, 1, 1, 1)
    new = [r for r in store.get("b").objects if r.key not in {o.key for o in store.get("a").objects}]
    pack = next(k for k in puts if k.startswith("kv/packs/"))
    assert stats.bytes == sum(r.size for r in new) < puts["bytes packs"] < stats.bytes + 2048  # members + index
    assert s3.client.head_object(Bucket=s3.bucket, Key=pack)["ContentLength"] == puts["bytes packs"]
    puts.clear()
    assert store.push().up_to_date == ("a", "b") and sum(puts.values()) == 0  # nothing sent at all
    b = s3_store(tmp_path / "b", s3)
    for name in ("a", "b"):
        b.pull(name)
        assert_same_snapshot(b.load(name)[0], store.load(name)[0])
    store.close()
    b.close()


def test_two_homes_pushing_one_name(s3, tmp_path):
    one, two = s3_store(tmp_path / "one", s3), s3_store(tmp_path / "two", s3)
    put(one, "x", make_snapshot(300, layouts=PLAIN), token_ids(300))
    put(two, "x", make_snapshot(400, layouts=PLAIN, seed=6), token_ids(400, seed=1))
    one.push("x")
    with pytest.raises(ConflictError, match="already holds a different entry x.*pull it"):
        two.push("x")
    assert one.info("x", remote=True).tokens == 300
    two.pull("x")  # take the bucket's version
    assert two.get("x").tokens == one.get("x").tokens and two.push("x").up_to_date == ("x",)
    put(one, "x", make_snapshot(500, layouts=PLAIN, seed=12), token_ids(500, seed=2))
    assert one.push("x").up_to_date == ()  # the bucket still held one's version: replaced (If-Match)
    put(two, "x", make_snapshot(600, layouts=PLAIN, seed=18), token_ids(600, seed=3))
    with pytest.raises(ConflictError):
        two.push("x")  # two descends from the version one has since replaced
    assert one.info("x", remote=True).tokens == 500
    one.close()
    two.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_down_mid_push_then_resumed(s3, tmp_path, monkeypatch):
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()  # shares the session server's in-process buckets
    store = s3_store(tmp_path / "a", s3, endpoint=f"http://127.0.0.1:{port}", s3_concurrency=1,
                     s3_max_attempts=1, s3_connect_timeout=0.5)
    put(store, "big", make_snapshot(2000, layouts=PLAIN), token_ids(2000))
    total = len(store.get("big").objects)
    monkeypatch.setattr(transfer, "PACK_BYTES", 1)  # a pack per object

    uploads = []

    def stop_before_the_fifth_pack(request, **_):  # the server goes down mid-push, for real
        if request.method == "PUT" and "/packs/" in request.url:
            uploads.append(request.url)
            if len(uploads) == 5:
                server.stop()

    store._tiers.s3.client.meta.events.register("before-send.s3.PutObject", stop_before_the_fifth_pack)
    with pytest.raises(RemoteUnreachable, match=f"127.0.0.1:{port}"):
        store.push("big")
    store._tiers.s3.client.meta.events.unregister("before-send.s3.PutObject", stop_before_the_fifth_pack)
    finished = bucket_keys(s3, "kv/packs/")
    assert len(finished) == 4 and total == 10 and not bucket_keys(s3, "kv/manifests/")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        puts = count_puts(store)
        stats = store.push("big")
    finally:
        server.stop()
    assert (stats.transferred, stats.skipped) == (total - 4, 4)
    assert not finished & {k for k in puts if k.startswith("kv/")}  # finished packs were not sent again
    assert len(bucket_keys(s3, "kv/packs/")) == total and bucket_keys(s3, "kv/manifests/") == {"kv/manifests/big.json"}
    b = s3_store(tmp_path / "b", s3)
    b.pull("big")
    assert_same_snapshot(b.load("big")[0], store.load("big")[0])
    store.close()
    b.close()


def test_a_damaged_bucket_object_is_a_miss_never_data(s3, tmp_path):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "a", snap, tokens)
    a.push("a")
    m = a.get("a")
    s3.damage(a._tiers.s3, "a", m.blocks[1].key)  # one member of the entry's pack
    b = s3_store(tmp_path / "b", s3)
    with pytest.raises(CorruptBlock, match=m.blocks[1].key.hex()):
        b.pull("a")
    assert b.ls() == []  # nothing published
    # Nor can the bucket's copy stand in for a lost local one.
    a._tiers.lmdb.delete_objects([m.blocks[1].key])
    a.close()
    a = s3_store(tmp_path / "a", s3)  # and out of memory
    with pytest.raises(CorruptBlock, match="S3 copy"):
        a.load("a")
    match = a.lookup(tokens[:-1], model=MODEL.digest, codec=CODEC.digest)
    assert match.tokens == 256  # the remote index now knows the bucket's copy is bad
    restored, stats = a.restore(match)
    assert_same_snapshot(restored, join_blocks(split_snapshot(snap), 1))
    a.close()
    b.close()


def test_a_lost_local_object_is_fetched_from_the_bucket_and_promoted(s3, tmp_path):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    store = s3_store(tmp_path / "a", s3)
    put(store, "a", snap, tokens)
    store.push("a")
    key = store.get("a").blocks[2].key
    store._tiers.lmdb.delete_objects([key])
    store.close()
    store = s3_store(tmp_path / "a", s3)
    restored, stats = store.load("a")
    assert_same_snapshot(restored, snap)
    assert stats.tier == "s3" and stats.objects == {"lmdb": 4, "s3": 1}
    assert store._tiers.lmdb.has_object(key) and store.verify() == []
    store.close()


def test_a_block_damaged_in_lmdb_comes_from_the_bucket_beside_blocks_decoded_in_place(s3, tmp_path):
    """The blocks LMDB holds intact are decoded into one run; the damaged one in the middle is
    quarantined and fetched from the bucket, and the join takes it in its place."""
    snap, tokens = make_snapshot(1200, layouts=PLAIN), token_ids(1200)
    store = s3_store(tmp_path / "a", s3)
    put(store, "a", snap, tokens)
    store.push("a")
    key = store.get("a").blocks[2].key
    path = str(store._tiers.lmdb.path)
    store.close()
    flip_segment_byte(path, key)
    store = s3_store(tmp_path / "a", s3)
    restored, stats = store.load("a")
    assert_same_snapshot(restored, snap)
    assert stats.objects == {"lmdb": 6, "s3": 1}
    assert any(key.hex()[:12] in m and "quarantined" in m for m in stats.misses)
    store.close()


def test_lookup_finds_what_only_the_bucket_holds(s3, tmp_path):
    snap, tokens = make_snapshot(900, layouts=PLAIN), token_ids(900)
    a = s3_store(tmp_path / "a", s3)
    put(a, "a", snap, tokens)
    a.push("a")
    b = s3_store(tmp_path / "b", s3)
    match = b.lookup(tokens[:600] + [1, 2], model=MODEL.digest, codec=CODEC.digest)
    assert (match.tokens, match.tier, match.remote, match.entry) == (512, "s3", True, None)
    restored, stats = b.restore(match)
    assert stats.tier == "s3" and stats.objects == {"s3": 4}
    assert_same_snapshot(restored, join_blocks(split_snapshot(snap), 2))
    assert b.lookup(tokens[:600], model=MODEL.digest, codec=CODEC.digest).tier == "memory"
    whole = b.lookup(tokens, model=MODEL.digest, codec=CODEC.digest)
    assert (whole.tokens, whole.entry, whole.tier) == (900, "a", "s3")  # two blocks are still only in the bucket
    assert b.stats().tiers["s3"].entries == 1
    a.close()
    b.close()


def test_remote_rm_and_gc(s3, tmp_path):
    store = s3_store(tmp_path / "a", s3)
    base = token_ids(512)
    put(store, "a", make_snapshot(600, layouts=PLAIN), base + token_ids(88, seed=1))
    put(store, "b", make_snapshot(700, layouts=PLAIN, seed=6), base + token_ids(188, seed=2))
    put(store, "brief", make_snapshot(300, layouts=PLAIN, seed=12), token_ids(300, seed=3), ttl=0.5)
    store.push()
    store.rm("a", remote=True)
    assert [e.name for e in store.ls(remote=True)] == ["b", "brief"]
    assert [e.name for e in store.ls()] == ["a", "b", "brief"]
    with pytest.raises(NotFound, match="ls --remote"):
        store.rm("a", remote=True)
    first = store.gc(remote=True)
    assert first.remote_orphans == 0  # unreferenced, but too young: a push elsewhere may be in flight
    time.sleep(0.5)
    second = store.gc(remote=True, remote_grace=0)
    assert first.remote_expired + second.remote_expired == ("brief",)
    assert first.expired + second.expired == ("brief",)
    # brief's pack goes; a's stays whole, since b uses its first two blocks and the codecs.
    packs = {store._tiers.s3.pack_name(p) for p in _packs_of(store, s3, "b")}
    assert second.remote_orphans == 1 and len(packs) == 2 and bucket_keys(s3, "kv/packs/") == packs
    assert bucket_keys(s3, "kv/maps/") == {store._tiers.s3.map_name(manifest_address(_bucket_manifest(store, "b")))}
    b = s3_store(tmp_path / "b", s3)
    b.pull("b")
    assert_same_snapshot(b.load("b")[0], store.load("b")[0])
    store.rm("b", remote=True)  # now no member of either pack is used
    third = store.gc(remote=True, remote_grace=0)
    assert third.remote_orphans == 2 and not bucket_keys(s3, "kv/")
    store.close()
    b.close()


def _bucket_manifest(store, name):
    return Manifest.from_bytes(store._tiers.s3.get_manifest(name)[0])


def _packs_of(store, s3, name) -> set[str]:
    """The packs bucket entry `name` takes its objects from."""
    manifest = _bucket_manifest(store, name)
    where = parse_map(store._tiers.s3.get_map(manifest_address(manifest)), manifest)
    return {loc.pack for loc in where.values()}


def test_first_blocks_of_another_save_never_mix(s3, tmp_path):
    tokens = token_ids(600)
    one, two = s3_store(tmp_path / "one", s3), s3_store(tmp_path / "two", s3)
    put(one, "a", make_snapshot(600, layouts=[Layout.CALIBRATED], seed=0), tokens)
    put(two, "b", make_snapshot(600, layouts=[Layout.CALIBRATED], seed=3), tokens)
    one.push("a")
    with pytest.raises(ConflictError, match="another save"):
        two.push("b")
    assert [e.name for e in two.ls(remote=True)] == ["a"]
    with pytest.raises(ConflictError, match="used by b"):
        two.pull("a")
    assert [e.name for e in two.ls()] == ["b"]
    one.close()
    two.close()


def test_without_a_bucket(tmp_path):
    store = open_store(tmp_path / "home")
    for call in (lambda: store.push(), lambda: store.pull("x"), lambda: store.ls(remote=True),
                 lambda: store.gc(remote=True)):
        with pytest.raises(RemoteNotConfigured, match="TQSTORE_S3_URL"):
            call()
    store.close()


def test_pull_streams_its_objects_and_stops_at_the_first_damaged_one(s3, tmp_path):
    """Pull writes batches of 2 x concurrency objects as they are verified; the members of a
    pack come in ranged GETs of up to a part; a damaged member stops it and publishes nothing."""
    snap, tokens = make_snapshot(2600, layouts=PLAIN), token_ids(2600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "a", snap, tokens)
    a.push("a")
    m = a.get("a")
    assert len(m.objects) >= 10
    b = s3_store(tmp_path / "b", s3, s3_concurrency=1)  # batches of 2, GETs up to 4 objects ahead
    writes = []
    put_objects = b._tiers.lmdb.put_objects
    b._tiers.lmdb.put_objects = lambda objects, **kw: writes.append(len(objects)) or put_objects(objects, **kw)
    assert b.pull("a").transferred == len(m.objects)
    assert writes == [2] * (len(m.objects) // 2) + [1] * (len(m.objects) % 2)
    restored, _ = b.load("a")
    assert_same_snapshot(restored, snap)
    b.close()

    damaged = 5  # in the order pull fetches: blocks, window, codecs
    s3.damage(a._tiers.s3, "a", m.blocks[damaged].key)
    c = s3_store(tmp_path / "c", s3, s3_concurrency=1)
    gets = Counter()
    c._tiers.s3.client.meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: gets.update([params["Key"].split("/")[1]]))
    with pytest.raises(CorruptBlock, match=m.blocks[damaged].key.hex()):
        c.pull("a")
    assert c.ls() == [] and c.verify() == []  # nothing published
    assert gets == {"manifests": 1, "maps": 1, "packs": 1}  # the whole entry in one ranged GET of its pack
    a.close()
    c.close()
