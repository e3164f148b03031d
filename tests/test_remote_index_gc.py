"""One Store (a long-lived server or notebook) that removes an entry from the bucket, collects the
bucket (`gc(remote=True)`) and pushes the entry again leaves a bucket that pulls: what the remote
gc deleted (the entry's map, its packs) is forgotten by the remote index of that process, so the
push writes them again instead of trusting what it remembered. The CLI never met this (each
command is a new process). Against a real S3 server (moto, `s3` fixture)."""

from __future__ import annotations

import mlx.core as mx
from test_blocks import assert_same_snapshot, make_snapshot
from test_store import PLAIN, put, token_ids
from test_store_s3 import bucket_keys, count_puts, put_sharing, s3_store

from tqstore.format.manifest import Manifest
from tqstore.store.packs import manifest_address


def _assert_equal_arrays(restored, original) -> None:
    """Every array of `restored` equal (mx.array_equal; the synthetic arrays hold NaNs on purpose) to
    `original`'s, then every byte (NaN payloads included) and every field."""
    for x, y in zip(restored.layers, original.layers, strict=True):
        for n in y.arrays:
            assert mx.array_equal(x.arrays[n], y.arrays[n], equal_nan=True).item(), n
    assert_same_snapshot(restored, original)


def _bucket_map(store, name) -> str:
    """The bucket key of the map of the local entry `name` as pushed (the bucket's manifest)."""
    s3 = store._tiers.s3
    return s3.map_name(manifest_address(Manifest.from_bytes(s3.get_manifest(name)[0])))


def test_rm_gc_then_push_again_in_one_store(s3, tmp_path):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)  # 2 blocks, window, codecs: one pack
    store = s3_store(tmp_path / "a", s3)
    put(store, "p", snap, tokens)
    store.push("p")
    objects = store.get("p").objects
    store.rm("p", remote=True)
    gone = store.gc(remote=True, remote_grace=0)
    assert gone.remote_orphans == 1 and not bucket_keys(s3, "kv/")  # its pack and its map went
    assert gone.remote_maps == 1 and gone.remote_map_bytes > 0  # the map counted too (before: nowhere)
    assert not any(store._tiers.remote.has(r.key) for r in objects)  # and the index forgot them

    puts = count_puts(store)
    stats = store.push("p")
    assert (stats.transferred, stats.skipped, stats.warnings) == (len(objects), 0, ())
    assert (puts["objects"], puts["packs"], puts["maps"], puts["manifests"]) == (0, 1, 1, 1)
    assert _bucket_map(store, "p") in bucket_keys(s3, "kv/maps/")

    fresh = s3_store(tmp_path / "fresh", s3)
    fresh.pull("p")
    _assert_equal_arrays(fresh.load("p")[0], snap)
    assert fresh.verify() == [] and store.verify(remote=True) == []
    puts.clear()
    assert store.push("p").up_to_date == ("p",) and sum(puts.values()) == 0  # nothing sent again
    store.close()
    fresh.close()


def test_rm_gc_then_push_again_beside_an_entry_sharing_blocks(s3, tmp_path):
    """b (pushed first, kept) shares a's first blocks and codecs: a's map points into b's pack for
    them, and a's own pack holds the rest. rm a + gc deletes a's map and a's own pack (no member
    of it is in use) and keeps b's; the push of a again sends a's pack and map again."""
    store = s3_store(tmp_path / "a", s3)
    snaps = put_sharing(store, 1000, 1100, 768)
    store.push("b")
    store.push("a")
    a_only = [r for r in store.get("a").objects if r.key not in {o.key for o in store.get("b").objects}]
    packs_b = bucket_keys(s3, "kv/packs/")
    store.rm("a", remote=True)
    gone = store.gc(remote=True, remote_grace=0)
    assert gone.remote_orphans == 1 and len(bucket_keys(s3, "kv/packs/")) == 1  # a's pack went, b's stays
    assert bucket_keys(s3, "kv/maps/") == {_bucket_map(store, "b")}
    assert not any(store._tiers.remote.has(r.key) for r in a_only)
    assert all(store._tiers.remote.has(r.key) for r in store.get("b").objects)

    puts = count_puts(store)
    stats = store.push("a")
    assert (stats.transferred, stats.skipped) == (len(a_only), len(store.get("a").objects) - len(a_only))
    assert (puts["objects"], puts["packs"], puts["maps"], puts["manifests"]) == (0, 1, 1, 1)
    assert bucket_keys(s3, "kv/packs/") >= packs_b

    fresh = s3_store(tmp_path / "fresh", s3)
    for name in ("a", "b"):  # b's first blocks are a's (put_sharing: same tokens, same keys): as stored
        fresh.pull(name)
        _assert_equal_arrays(fresh.load(name)[0], store.load(name)[0])
    _assert_equal_arrays(fresh.load("a")[0], snaps["a"])
    assert fresh.verify() == [] and store.verify(remote=True) == []
    store.close()
    fresh.close()
