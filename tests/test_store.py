"""The Store on a real LMDB environment (tmp_path): put, lookup, restore, budgets, faults.

Snapshots are synthetic (`test_blocks.make_snapshot`: 2 KV heads, head dim 64) except in the
end-to-end test, which prefills a tiny random-weight llama. test_store_s3.py covers the bucket,
test_store_crash.py several processes and SIGKILL.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest

from lmdb_damage import flip_segment_byte
from test_blocks import assert_same_array, assert_same_snapshot, make_snapshot
from test_tier_lmdb import HOLD_OPEN
from tiny_models import build_model, prompt_tokens
from tqstore import Store
from tqstore.format import objects as F
from tqstore.format.blocks import GroupedLayers, join_blocks, split_snapshot
from tqstore.config import load_config
from tqstore.errors import ConflictError, CorruptBlock, InvalidName, NotFound, RemoteError, TokenMismatch
from tqstore.models.identity import CodecIdentity, ModelIdentity
from tqstore.store.tiers.memory import HotObject
from turboquant import make_prompt_cache, restore, snapshot
from turboquant.records import TOKEN_AXIS, Layout

MODEL = ModelIdentity("weights-a", {"num_hidden_layers": 2}, None, None, None, "float16", "synthetic")
OTHER_MODEL = ModelIdentity("weights-b", {"num_hidden_layers": 2}, None, None, None, "float16", "synthetic")
CODEC = CodecIdentity("turbo4", (), {})
OTHER_CODEC = CodecIdentity("turbo3", (), {})
# make_layer seeds layer i with seed + i: an even seed gives a plain KVCache layer (no calibration)
# and a TurboQuant layer compressed to the last token, so entries sharing tokens share every block.
PLAIN = [Layout.RAW, Layout.TURBO]


def open_store(home, **settings) -> Store:
    """A Store on `home` with test settings (no free-disk guard, 64 KiB segments)."""
    return Store.open(config=load_config(home, {"min_free_disk_bytes": 0, "segment_size": "64KiB", **settings}))


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "home")
    yield s
    s.close()


def token_ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def put(store: Store, name: str, snap, tokens, model=MODEL, codec=CODEC, **kw):
    return store.put(name, snap, tokens, model=model, codec=codec, model_ref="synthetic", prefill_seconds=1.5, **kw)


def reopen(store: Store, **settings) -> Store:
    """Close and open again: the memory tier starts empty."""
    home = store.home
    store.close()
    return open_store(home, **settings)


def lmdb_tier(store: Store):
    return store._tiers.lmdb


# -- put, load, ls -----------------------------------------------------------------------------


def test_put_load_round_trip(store):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    result = put(store, "project-x", snap, tokens, metadata={"file": "contract.txt"}, adapter_path="./lora")
    assert (result.new_blocks, result.reused_blocks, result.warnings) == (3, 0, ())
    assert result.bytes_written == result.manifest.nbytes > 0
    assert_same_snapshot(result.snapshot, snap)
    store = reopen(store)
    loaded, stats = store.load("project-x")
    assert_same_snapshot(loaded, snap)
    assert (stats.tier, stats.tokens, stats.objects) == ("lmdb", 600, {"lmdb": 5})
    assert stats.bytes == result.manifest.nbytes and stats.seconds > 0 and stats.misses == ()
    _, again = store.load("project-x")
    assert again.tier == "memory"  # promoted
    m = store.get("project-x")
    assert (m.tokens, m.scheme, m.model_ref, m.adapter_path, m.metadata, m.sliding) == (
        tuple(tokens), "turbo4", "synthetic", "./lora", {"file": "contract.txt"}, False)
    assert m.model_identity == MODEL and m.model_identity.source == "synthetic"
    [info] = store.ls()
    assert (info.name, info.tokens, info.blocks, info.bytes, info.prefill_seconds) == ("project-x", 600, 3,
                                                                                         m.nbytes, 1.5)
    assert store.info("project-x") == info and info.last_used >= info.created
    assert store.stats().tiers["lmdb"].hits == 5 and store.stats().tiers["memory"].hits == 5
    assert store.verify() == []
    store.close()


def test_memory_tier_holds_blocks_in_groups_after_a_put(store):
    """What a put leaves in the memory tier is what a restore from LMDB decodes: each block's
    arrays in their stored groups (not slices of the caller's arrays), joined by group into the
    same bytes, without a record per layer and block."""
    snap, tokens = make_snapshot(600, layouts=[Layout.TURBO, Layout.TURBO], seed=4), token_ids(600)
    result = put(store, "e", snap, tokens)
    hot = [store._tiers.memory.get(ref.key) for ref in result.manifest.blocks]
    assert all(isinstance(h.obj.layers, GroupedLayers) for h in hot)
    loaded, stats = store.load("e")
    assert stats.tier == "memory"
    assert all(h.obj.layers._records is None for h in hot), "the restore built per-layer records"
    assert_same_snapshot(loaded, snap)


def test_put_returns_the_stored_canonical_snapshot(store):
    tokens = token_ids(600)
    first = make_snapshot(600, layouts=PLAIN, seed=0)
    put(store, "a", first, tokens)
    second = make_snapshot(700, layouts=PLAIN, seed=6)  # other arrays for the same first 512 tokens
    result = put(store, "b", second, tokens[:512] + token_ids(188, seed=9))
    assert (result.new_blocks, result.reused_blocks) == (1, 2)
    stored = join_blocks(split_snapshot(first), 2)
    for got, want, mine in zip(result.snapshot.layers, stored.layers, second.layers):
        for name, a in want.arrays.items():
            assert_same_array(got.arrays[name][:, :, :512], a, name)  # the stored blocks, not the caller's
            theirs = np.asarray(mine.arrays[name][:, :, :512])
            assert not np.array_equal(np.asarray(got.arrays[name][:, :, :512]), theirs)
    store = reopen(store)
    assert_same_snapshot(store.load("b")[0], result.snapshot)
    store.close()


def test_an_entry_without_tokens(store):
    snap = make_snapshot(0, layouts=PLAIN)
    result = put(store, "empty", snap, [])
    assert (result.new_blocks, len(result.manifest.objects)) == (0, 2)
    store = reopen(store)
    assert_same_snapshot(store.load("empty")[0], snap)
    assert store.lookup([1, 2, 3], model=MODEL.digest, codec=CODEC.digest) is None
    store.close()


def test_a_put_commits_its_last_objects_and_its_manifest_in_one_transaction(store, monkeypatch):
    """One synced commit for an entry of one batch (there were two: objects, then manifest); an
    entry of several batches commits each batch before the last on its own, the last with the
    manifest, and loads whole."""
    import tqstore.store.put as put_module

    env = lmdb_tier(store)._env._env
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    before = env.info()["last_txnid"]
    put(store, "one", snap, tokens)
    assert env.info()["last_txnid"] - before == 1
    monkeypatch.setattr(put_module, "_BATCH_BYTES", 1)  # every object a batch of its own
    before = env.info()["last_txnid"]
    result = put(store, "many", make_snapshot(600, layouts=PLAIN, seed=2), token_ids(600, seed=1))
    # 3 new blocks and a window (the shared codecs are entry "one"'s): four batches, four commits
    assert result.new_blocks == 3 and env.info()["last_txnid"] - before == 4
    assert_same_snapshot(store.load("many")[0], make_snapshot(600, layouts=PLAIN, seed=2))
    assert store.verify() == []


def test_a_put_racing_another_writer_continues_from_the_copy_stored_first(store, tmp_path, monkeypatch):
    tokens, theirs = token_ids(300), make_snapshot(300, layouts=PLAIN, seed=6)
    other = open_store(tmp_path / "other")
    keys = [r.key for r in put(other, "t", theirs, tokens).manifest.objects]
    their_payloads = {k: lmdb_tier(other).get_object(k) for k in keys}
    other.close()
    tier, first = lmdb_tier(store), []
    real_put_objects = tier.put_objects

    def another_process_wins(objects, sha256s=None, **manifest):
        if not first:  # between this put's plan and its writes, another process stores its copies
            first.append(real_put_objects(their_payloads))
        return real_put_objects(objects, sha256s, **manifest)

    monkeypatch.setattr(tier, "put_objects", another_process_wins)
    result = put(store, "mine", make_snapshot(300, layouts=PLAIN), tokens)
    assert_same_snapshot(result.snapshot, theirs)
    assert result.reused_blocks == 2 and result.new_blocks == 0
    assert_same_snapshot(store.load("mine")[0], theirs) and store.verify() == []


def test_put_checks_its_arguments(store):
    snap = make_snapshot(10, layouts=PLAIN)
    with pytest.raises(InvalidName):
        put(store, "../x", snap, token_ids(10))
    with pytest.raises(TokenMismatch, match="9 tokens were given for a snapshot holding 10"):
        put(store, "x", snap, token_ids(9))
    with pytest.raises(ValueError, match="metadata"):
        put(store, "x", snap, token_ids(10), metadata={"n": 1})
    with pytest.raises(ValueError, match="ttl"):
        put(store, "x", snap, token_ids(10), ttl=0)
    assert store.ls() == [] and lmdb_tier(store).stats().object_count == 0


def test_a_first_block_calibrated_otherwise_is_a_conflict(store):
    tokens = token_ids(600)
    put(store, "a", make_snapshot(600, layouts=[Layout.CALIBRATED], seed=0), tokens)
    other = make_snapshot(600, layouts=[Layout.CALIBRATED], seed=3)
    with pytest.raises(ConflictError, match="restore the stored prefix first"):
        put(store, "b", other, tokens)
    assert [e.name for e in store.ls()] == ["a"]
    assert_same_snapshot(store.load("a")[0], make_snapshot(600, layouts=[Layout.CALIBRATED], seed=0))


def test_replacing_an_entry(store):
    put(store, "x", make_snapshot(300, layouts=PLAIN), token_ids(300))
    snap = make_snapshot(400, layouts=PLAIN, seed=6)
    put(store, "x", snap, token_ids(400, seed=5))
    assert_same_snapshot(store.load("x")[0], snap)
    assert store.gc().orphans == 3  # the old entry's two blocks and window


# -- lookup ------------------------------------------------------------------------------------


def test_longest_prefix_lookup(store):
    base = token_ids(1000)
    a_tokens, b_tokens = base + token_ids(200, seed=1), base + token_ids(300, seed=2)
    a = make_snapshot(1200, layouts=PLAIN, seed=0)
    put(store, "a", a, a_tokens)
    assert put(store, "b", make_snapshot(1300, layouts=PLAIN, seed=6), b_tokens).reused_blocks == 3
    store = reopen(store)
    query = base[:700] + token_ids(300, seed=3)  # diverges at token 700
    match = store.lookup(query, model=MODEL.digest, codec=CODEC.digest)
    assert (match.tokens, match.entry, match.tier) == (512, None, "lmdb")
    assert list(match.keys) == store.get("a").keys[:2]
    restored, stats = store.restore(match)
    assert stats.tokens == restored.offset == 512 and stats.tier == "lmdb"
    assert_same_snapshot(restored, join_blocks(split_snapshot(a), 2))
    assert store.lookup(query, model=MODEL.digest, codec=CODEC.digest).tier == "memory"
    assert store.lookup(query, model=OTHER_MODEL.digest, codec=CODEC.digest) is None
    assert store.lookup(query, model=MODEL.digest, codec=OTHER_CODEC.digest) is None
    diverge_late = base + token_ids(50, seed=4)
    assert store.lookup(diverge_late, model=MODEL.digest, codec=CODEC.digest).tokens == 768
    whole = store.lookup(a_tokens + [7, 8], model=MODEL.digest, codec=CODEC.digest)
    assert (whole.tokens, whole.entry, len(whole.keys)) == (1200, "a", 5)
    assert store.lookup(token_ids(900, seed=8), model=MODEL.digest, codec=CODEC.digest) is None
    store.close()


def test_a_lookup_reads_lmdb_in_a_fixed_number_of_transactions(store, monkeypatch):
    """Which tier holds each block is asked in one read transaction, not one per block (258 of
    them took 4 ms of a 64k-token lookup, bench/lookup_cost.py), whatever the entry's length."""
    tokens = token_ids(1200)
    put(store, "a", make_snapshot(1200, layouts=PLAIN), tokens)
    store = reopen(store)
    env = lmdb_tier(store)._env
    reads = []
    real = env.read
    monkeypatch.setattr(env, "read", lambda fn: reads.append(fn) or real(fn))
    for query in (tokens + [5], tokens[:900] + [5] * 10):
        reads.clear()
        match = store.lookup(query, model=MODEL.digest, codec=CODEC.digest)
        assert (match.tokens, match.tier) == (1200 if len(query) > 1200 else 768, "lmdb")
        assert len(reads) <= 3  # the manifest list, the manifest (first time), the key index
    store.close()


def test_a_partial_last_block_matches_as_a_whole_entry(store):
    tokens = token_ids(300)
    put(store, "c", make_snapshot(300, layouts=PLAIN), tokens)
    match = store.lookup(tokens + [1, 2, 3], model=MODEL.digest, codec=CODEC.digest)
    assert (match.tokens, match.entry) == (300, "c")
    assert store.restore(match)[0].offset == 300
    assert store.lookup(tokens[:290], model=MODEL.digest, codec=CODEC.digest).tokens == 256
    assert store.lookup(tokens[:200], model=MODEL.digest, codec=CODEC.digest) is None


def test_sliding_window_entries_match_only_whole(store):
    tokens = token_ids(600)
    snap = make_snapshot(600, layouts=[Layout.RAW, Layout.ROTATING, Layout.TURBO])
    assert put(store, "s", snap, tokens).manifest.sliding
    match = store.lookup(tokens + [5], model=MODEL.digest, codec=CODEC.digest)
    assert (match.tokens, match.entry) == (600, "s")
    assert_same_snapshot(store.restore(match)[0], snap)
    assert store.lookup(tokens[:550] + [5] * 10, model=MODEL.digest, codec=CODEC.digest) is None


def test_expired_entries_are_not_served(store):
    tokens = token_ids(300)
    put(store, "brief", make_snapshot(300, layouts=PLAIN), tokens, ttl=0.05)
    put(store, "kept", make_snapshot(300, layouts=PLAIN, seed=6), token_ids(300, seed=1), ttl=0.05, pin=True)
    time.sleep(0.1)
    assert store.lookup(tokens + [1], model=MODEL.digest, codec=CODEC.digest) is None
    with pytest.raises(NotFound, match="expired"):
        store.load("brief")
    assert [(e.name, e.expired) for e in store.ls()] == [("brief", True), ("kept", False)]  # pins outlive TTLs
    assert store.gc().expired == ("brief",)
    assert [e.name for e in store.ls()] == ["kept"] and store.load("kept")[1].tokens == 300
    store.unpin("kept")
    assert store.gc().expired == ("kept",)


# -- budgets -----------------------------------------------------------------------------------


def _budget_entries():
    base = token_ids(512, seed=20)
    return [("p", make_snapshot(600, layouts=PLAIN, seed=0), token_ids(600, seed=21), {"pin": True}),
            ("x", make_snapshot(612, layouts=PLAIN, seed=6), base + token_ids(100, seed=22), {}),
            ("y", make_snapshot(612, layouts=PLAIN, seed=12), base + token_ids(100, seed=23), {}),
            ("e", make_snapshot(300, layouts=PLAIN, seed=18), token_ids(300, seed=24), {"ttl": 0.3}),
            ("z", make_snapshot(1500, layouts=PLAIN, seed=24), token_ids(1500, seed=25), {})]


def test_budget_eviction_keeps_pinned_and_referenced_blocks(tmp_path):
    probe = open_store(tmp_path / "probe")
    for name, snap, tokens, kw in _budget_entries():
        put(probe, name, snap, tokens, **kw)
    manifests = {e.name: probe.get(e.name) for e in probe.ls()}
    total = lmdb_tier(probe).stats().payload_bytes
    probe.close()
    unique = {n: sum(r.size for r in m.objects if all(r.key not in {o.key for o in other.objects}
                                                      for k, other in manifests.items() if k != n))
              for n, m in manifests.items()}
    store = open_store(tmp_path / "home", lmdb_budget_bytes=total - unique["e"] - unique["x"])
    evicted = []
    for name, snap, tokens, kw in _budget_entries():
        if name == "z":
            time.sleep(0.35)  # e expires: it goes first although it is more recent than x
        evicted += put(store, name, snap, tokens, **kw).evicted
    assert evicted == ["e", "x"]
    assert [e.name for e in store.ls()] == ["p", "y", "z"]
    assert store.stats().evicted_entries == 2
    assert lmdb_tier(store).stats().payload_bytes <= store.config.lmdb_budget_bytes
    shared = set(manifests["x"].keys[:2])
    assert shared <= set(store.get("y").keys) and all(lmdb_tier(store).has_object(k.raw) for k in shared)
    for name, snap, _, _ in _budget_entries():
        if name in ("p", "z"):
            assert_same_snapshot(store.load(name)[0], snap)
    store.load("y")
    assert store.verify() == []
    store.close()


def test_an_entry_alone_over_the_budget_stays_with_a_warning(tmp_path):
    store = open_store(tmp_path / "home", lmdb_budget_bytes=1000)
    put(store, "old", make_snapshot(300, layouts=PLAIN), token_ids(300))
    result = put(store, "big", make_snapshot(600, layouts=PLAIN, seed=6), token_ids(600, seed=1))
    assert result.evicted == ("old",)
    assert "over its budget" in result.warnings[0] and "big" in result.warnings[0]
    assert store.load("big")[1].tokens == 600
    store.close()


def test_the_map_grows_past_a_tiny_initial_size(tmp_path):
    store = open_store(tmp_path / "home", lmdb_map_size="1MiB")
    snaps = [make_snapshot(1000, layouts=PLAIN, seed=6 * i) for i in range(6)]
    for i, snap in enumerate(snaps):
        put(store, f"e{i}", snap, token_ids(1000, seed=i))
    assert store.stats().lmdb.map_bytes > 3 * (1 << 20)
    store = reopen(store, lmdb_map_size="1MiB")
    for i, snap in enumerate(snaps):
        assert_same_snapshot(store.load(f"e{i}")[0], snap)
    store.close()


# -- rm, pins, gc ------------------------------------------------------------------------------


def test_rm_frees_what_no_other_entry_uses(store):
    base = token_ids(512)
    put(store, "a", make_snapshot(600, layouts=PLAIN), base + token_ids(88, seed=1))
    put(store, "b", make_snapshot(700, layouts=PLAIN, seed=6), base + token_ids(188, seed=2))
    a, b = store.get("a"), store.get("b")
    store.rm("a")
    tier = lmdb_tier(store)
    assert not tier.has_object(a.blocks[2].key) and not tier.has_object(a.window.key)
    assert all(tier.has_object(r.key) for r in b.objects)
    assert store.load("b")[1].tokens == 700
    with pytest.raises(NotFound, match="tqstore ls"):
        store.rm("a")
    with pytest.raises(NotFound):
        store.load("a")


def test_pin_and_unpin(store):
    put(store, "a", make_snapshot(300, layouts=PLAIN), token_ids(300))
    store.pin("a")
    assert store.get("a").pinned and store.stats().tiers["memory"].bytes > 0
    assert store._tiers.memory.stats().pinned_bytes == store._tiers.memory.stats().bytes
    store.unpin("a")
    assert not store.get("a").pinned and store._tiers.memory.stats().pinned_bytes == 0
    with pytest.raises(NotFound):
        store.pin("nothing")


def test_a_pin_never_undoes_a_save_that_lands_while_it_runs(store, monkeypatch):
    """Before: pin read the manifest, then wrote it back pinned; a save of the entry between the
    two was overwritten by the old version (and its blocks then collected as unreferenced)."""
    put(store, "a", make_snapshot(300, layouts=PLAIN), token_ids(300))
    put(store, "b", make_snapshot(200, seed=2, layouts=PLAIN), token_ids(200, seed=2))
    saved = store.get("b").replace(name="a").to_bytes()  # "a" as the other writer stores it
    tier = lmdb_tier(store)
    read = tier.get_manifest

    def read_then_other_writer(name):
        data = read(name)
        monkeypatch.setattr(tier, "get_manifest", read)
        tier.put_manifest("a", saved)
        return data

    monkeypatch.setattr(tier, "get_manifest", read_then_other_writer)
    store.pin("a")
    stored = store.get("a")
    assert stored.pinned and stored.tokens == store.get("b").tokens


def test_a_push_keeps_the_entry_s_place_in_eviction(tmp_path, s3):
    """Before: a push recorded the bucket's etag through a manifest write that also marked the
    entry used now, so `push --all` reordered LRU eviction by name."""
    store = open_store(tmp_path / "home", s3_url=f"s3://{s3.bucket}/kv", s3_endpoint=s3.endpoint,
                       s3_region="us-east-1")
    try:
        put(store, "a", make_snapshot(300, layouts=PLAIN), token_ids(300))
        put(store, "b", make_snapshot(200, seed=2, layouts=PLAIN), token_ids(200, seed=2))
        lmdb_tier(store).touch("a", 1000.0)
        lmdb_tier(store).touch("b", 2000.0)
        store.push()
        assert store.get("a").remote_etag and store.get("b").remote_etag
        assert {e.name: e.last_used for e in store.ls()} == {"a": 1000.0, "b": 2000.0}
    finally:
        store.close()


def test_an_expired_entry_is_neither_pushed_nor_pulled(tmp_path, s3):
    """Before: `pull` published an entry expired in the bucket (never matched or loaded after)
    and evicted live local entries to make room for it; `push NAME` uploaded an expired one."""
    bucket = {"s3_url": f"s3://{s3.bucket}/kv", "s3_endpoint": s3.endpoint, "s3_region": "us-east-1"}
    origin = open_store(tmp_path / "origin", **bucket)
    try:
        put(origin, "old", make_snapshot(300, layouts=PLAIN), token_ids(300), ttl=1.0)
        origin.push("old")
        put(origin, "later", make_snapshot(200, seed=2, layouts=PLAIN), token_ids(200, seed=2), ttl=1.0)
        time.sleep(1.1)
        with pytest.raises(NotFound, match="expired.*nothing was pushed"):
            origin.push("later")
        # Pinned, it lives on here, but the bucket drops pins: it would arrive expired.
        origin.pin("later")
        with pytest.raises(NotFound, match="pinned.*would arrive expired.*nothing was pushed"):
            origin.push("later")
        stats = origin.push()
        assert "later" not in stats.entries and any("later" in w and "not pushed" in w for w in stats.warnings)
        assert [e.name for e in origin.ls(remote=True)] == ["old"]
    finally:
        origin.close()
    reader = open_store(tmp_path / "reader", **bucket)
    try:
        put(reader, "live", make_snapshot(300, seed=4, layouts=PLAIN), token_ids(300, seed=4))
        with pytest.raises(NotFound, match="expired.*nothing was pulled"):
            reader.pull("old")
        assert [e.name for e in reader.ls()] == ["live"]
    finally:
        reader.close()


def test_gc_reports_what_it_did_when_its_remote_or_compact_part_cannot_run(tmp_path):
    """Before: `gc --remote` with the bucket down, and `gc --compact` with the store open in
    another process, removed the expired entries and then reported only the error (exit 1)."""
    down = open_store(tmp_path / "down", s3_url="s3://bkt/kv", s3_endpoint="http://127.0.0.1:9",
                      s3_region="us-east-1", s3_max_attempts=1, s3_connect_timeout=1)
    try:
        put(down, "old", make_snapshot(300, layouts=PLAIN), token_ids(300), ttl=0.01)
        time.sleep(0.05)
        with pytest.raises(RemoteError):
            down.gc(remote=True)
        assert [e.name for e in down.ls()] == ["old"]  # nothing was done, as the error says
    finally:
        down.close()
    store = open_store(tmp_path / "home")
    put(store, "old", make_snapshot(300, layouts=PLAIN), token_ids(300), ttl=0.01)
    time.sleep(0.05)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_OPEN), str(lmdb_tier(store).path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "open"
        stats = store.gc(compact=True)
        assert stats.expired == ("old",) and stats.compact is None
        assert any(note.startswith("compaction skipped") and str(child.pid) in note for note in stats.notes)
    finally:
        child.communicate("", timeout=30)
        store.close()


def test_gc_removes_orphans_and_quarantine_records(store):
    put(store, "a", make_snapshot(300, layouts=PLAIN), token_ids(300))
    tier = lmdb_tier(store)
    orphans = {hashlib.sha256(b"orphan%d" % i).digest(): b"x" * 100 for i in range(3)}
    tier.put_objects(orphans)
    _damage_segment(store, store.get("a").blocks[1].key)
    store = open_store(store.home)
    with pytest.raises(CorruptBlock):
        store.load("a")
    stats = store.gc()
    assert (stats.orphans, stats.orphan_bytes, stats.quarantine_cleared) == (3, 300, 1)
    assert lmdb_tier(store).quarantined() == []
    store.close()


def test_an_unreadable_manifest_stops_collection(store):
    put(store, "a", make_snapshot(300, layouts=PLAIN), token_ids(300))
    data = store.get("a").to_bytes().replace(b'"version":1', b'"version":9')
    lmdb_tier(store).put_manifest("future", data)
    lmdb_tier(store).put_objects({hashlib.sha256(b"orphan").digest(): b"x"})
    stats = store.gc()
    assert stats.orphans == 0 and "future" in stats.notes[0] and "newer tqstore" in stats.notes[0]
    assert [p.kind for p in store.verify()] == ["manifest"]


def test_one_store_per_home(tmp_path):
    a = open_store(tmp_path / "home")
    b = Store.open(tmp_path / "home" / ".." / "home")
    assert a is b
    b.close()
    assert a.ls() == []  # still open: one close per open
    a.close()
    with pytest.raises(Exception, match="closed"):
        a.ls()


# -- faults: a damaged copy is a miss with a reason, never wrong data ----------------------------


def test_objects_stored_in_format_2_keep_restoring(store):
    """A store written before format 3 holds format 2 objects: a restore from LMDB reads them
    (checked against their frame's SHA-256, the tier's not repeated) and a damaged one is still
    a miss."""
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    m = put(store, "old", snap, tokens).manifest
    tier = lmdb_tier(store)
    for ref in m.objects:
        hot = store._tiers.memory.get(ref.key)
        old = F.dumps(hot.obj, hot.provenance, version=2)
        assert F.inspect(old).version == 2
        tier.delete_objects([ref.key])
        tier.put_objects({ref.key: old})
    store = reopen(store)
    restored, stats = store.load("old")
    assert stats.tier == "lmdb" and not stats.misses
    assert_same_snapshot(restored, snap)
    key = m.blocks[1].key
    _damage_segment(store, key)
    store = open_store(store.home)
    with pytest.raises(CorruptBlock, match="sha256 does not match its frame"):
        store.load("old")
    store.close()


def _damage_segment(store: Store, key: bytes) -> None:
    """Flip a byte of the object's first segment in the LMDB file (the store is closed)."""
    path = str(lmdb_tier(store).path)
    store.close()
    flip_segment_byte(path, key)


def test_a_corrupt_lmdb_object_is_a_miss_and_quarantined(store):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    put(store, "a", snap, tokens)
    key = store.get("a").blocks[1].key
    _damage_segment(store, key)
    store = open_store(store.home)
    with pytest.raises(CorruptBlock, match="ChecksumMismatch|xxh3"):  # format 3 checks every byte itself
        store.load("a")
    [record] = lmdb_tier(store).quarantined()
    assert record.key == key and "ChecksumMismatch" in record.reason
    match = store.lookup(tokens + [1], model=MODEL.digest, codec=CODEC.digest)
    assert match.tokens == 256  # block 1 is gone: the stored prefix is block 0
    restored, stats = store.restore(match)
    assert_same_snapshot(restored, join_blocks(split_snapshot(snap), 1))
    assert [p.kind for p in store.verify("a")] == ["missing"]
    store.close()


def test_a_restore_from_lmdb_decodes_its_blocks_into_one_run(store):
    """Every block read from LMDB is copied, on the thread that read and checked it, into its
    token slice of one joined array per name (`LmdbReads`, `runs.Run`): the blocks the memory
    tier keeps are consecutive views of those arrays, and the join was a slice of them."""
    snap, tokens = make_snapshot(1200, layouts=[Layout.TURBO, Layout.RAW], seed=4), token_ids(1200)
    m = put(store, "e", snap, tokens).manifest
    store = reopen(store)
    restored, stats = store.load("e")
    assert_same_snapshot(restored, snap)
    assert stats.objects == {"lmdb": 7} and stats.misses == ()
    groups = [store._tiers.memory.get(ref.key).obj.layers.groups for ref in m.blocks]
    for k, first in enumerate(groups[0]):
        column = [g[k] for g in groups]
        assert all(g.base is first.base and g.name == first.name for g in column)
        assert [g.start for g in column] == [0] + [g.stop for g in column[:-1]]
        assert column[-1].stop == first.base.data.shape[TOKEN_AXIS + 1] == 1200
    store.close()


def test_a_block_that_does_not_fit_the_run_is_never_placed(store):
    """A middle block whose groups differ from the first block's (here: the same tokens, keys and
    identity, bfloat16 arrays where the entry holds float16) is not copied into the run
    allocated from the first and last blocks: it is read again on its own, and the join then
    finds it does not belong to the entry."""
    tokens = token_ids(1200)
    snap = make_snapshot(1200, layouts=PLAIN)
    m = put(store, "e", snap, tokens).manifest
    other = open_store(store.home.parent / "other")
    put(other, "e", make_snapshot(1200, mx.bfloat16, layouts=PLAIN), tokens)
    stranger = lmdb_tier(other).get_object(m.blocks[2].key)
    other.close()
    tier = lmdb_tier(store)
    tier.delete_objects([m.blocks[2].key])
    tier.put_object(m.blocks[2].key, stranger)
    store = reopen(store)
    with pytest.raises(CorruptBlock, match="do not fit together"):
        store.load("e")
    store.close()


def test_a_prefix_restore_stops_before_a_block_lost_meanwhile(store):
    snap, tokens = make_snapshot(900, layouts=PLAIN), token_ids(900)
    put(store, "a", snap, tokens)
    match = store.lookup(tokens[:800], model=MODEL.digest, codec=CODEC.digest)
    assert match.tokens == 768
    key = store.get("a").blocks[2].key
    _damage_segment(store, key)
    store = open_store(store.home)
    restored, stats = store.restore(match)
    assert stats.tokens == restored.offset == 512
    assert any(key.hex()[:12] in m and "xxh3" in m for m in stats.misses)
    assert_same_snapshot(restored, join_blocks(split_snapshot(snap), 2))
    store.close()


def test_wrong_content_under_a_key_is_quarantined(store):
    put(store, "a", make_snapshot(600, layouts=PLAIN), token_ids(600))
    m, tier = store.get("a"), lmdb_tier(store)
    tier.delete_objects([m.blocks[2].key])
    tier.put_object(m.blocks[2].key, tier.get_object(m.window.key))  # intact bytes, wrong object
    store = reopen(store)
    with pytest.raises(CorruptBlock, match="not a block"):
        store.load("a")
    [record] = lmdb_tier(store).quarantined()
    assert record.key == m.blocks[2].key and "MalformedHeader" in record.reason
    store.close()


def test_a_damaged_memory_copy_is_dropped_and_lmdb_serves(store):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    put(store, "a", snap, tokens)
    m, memory = store.get("a"), store._tiers.memory
    wrong = memory.get(m.blocks[0].key)
    memory.put(m.blocks[1].key, HotObject(wrong.obj, wrong.kind, wrong.provenance, wrong.sha256, wrong.nbytes))
    restored, stats = store.load("a")
    assert_same_snapshot(restored, snap)
    assert stats.objects == {"memory": 4, "lmdb": 1} and "dropped" in stats.misses[0]
    assert store.stats().tiers["memory"].hits >= 4


def test_verify_finds_missing_and_altered_objects(store):
    put(store, "a", make_snapshot(600, layouts=PLAIN), token_ids(600))
    m, tier = store.get("a"), lmdb_tier(store)
    tier.delete_objects([m.blocks[0].key])
    tier.delete_objects([m.window.key])
    tier.put_object(m.window.key, F.dumps(split_snapshot(make_snapshot(0, layouts=PLAIN)).window))
    kinds = {(p.kind, p.key) for p in store.verify("a")}
    assert ("missing", m.blocks[0].key) in kinds and ("digest", m.window.key) in kinds
    assert ("content", m.window.key) in kinds  # and quarantined
    with pytest.raises(NotFound):
        store.verify("nothing")


# -- end to end: a tiny model decodes from the restored cache exactly as from the original -------


def _prefill(model, scheme: str, tokens: mx.array):
    caches = make_prompt_cache(model, scheme)
    model(tokens[None], cache=caches)
    for c in caches:
        if hasattr(c, "compress"):
            c.compress()
    return caches


def decode_logits(model, caches, first: mx.array, steps: int = 4) -> list[mx.array]:
    """Greedy decode `steps` tokens from `first`; the logits of each step."""
    y, out = first, []
    for _ in range(steps):
        logits = model(y[None], cache=caches)[0, -1]
        mx.eval(logits)
        out.append(logits)
        y = mx.argmax(logits)[None]
    return out


def stored_model_entry(scheme: str = "turbo4", n: int = 260):
    """A tiny llama, a prompt, the original caches after prefill and their snapshot and identities."""
    model = build_model("llama")
    prompt = prompt_tokens(n + 1)
    caches = _prefill(model, scheme, prompt[:-1])
    snap = snapshot(caches)
    return model, prompt, caches, snap, ModelIdentity.from_model(model), CodecIdentity.from_snapshot(snap, scheme)


def test_restored_entry_decodes_like_the_original(store):
    model, prompt, caches, snap, model_id, codec_id = stored_model_entry()
    tokens = prompt[:-1].tolist()
    store.put("tiny", snap, tokens, model=model_id, codec=codec_id, model_ref="tiny-llama", prefill_seconds=0.1)
    store = reopen(store)
    match = store.lookup(tokens, model=model_id.digest, codec=codec_id.digest)
    assert (match.tokens, match.entry) == (260, "tiny")
    restored, stats = store.restore(match)
    expected = decode_logits(model, caches, prompt[-1:])
    for a, b in zip(expected, decode_logits(model, restore(restored), prompt[-1:])):
        assert mx.array_equal(a, b).item()
    store.close()


def test_restores_from_memory_share_their_codecs(store):
    """Each restore rebuilt every layer's TurboQuant codec from the stored records, so the GPU
    kernels' tables made from a codec (its rotation as a matrix, padded codebooks) were made again
    by every layer of every question asked of a stored context. The memory tier keeps the
    entry's codec records, and one codec object now serves all layers and restores of them."""
    model, prompt, _, snap, model_id, codec_id = stored_model_entry()
    tokens = prompt[:-1].tolist()
    store.put("tiny", snap, tokens, model=model_id, codec=codec_id, model_ref="tiny-llama", prefill_seconds=0.1)
    store = reopen(store)
    match = store.lookup(tokens, model=model_id.digest, codec=codec_id.digest)
    sides, plans = [], []
    for tier in ("lmdb", "memory", "memory"):
        restored, stats = store.restore(match)
        assert stats.tier == tier
        caches = restore(restored)
        sides.append([(c._key_side, c._value_side) for c in caches])
        plans.append([c.plan for c in caches])
    codecs = {id(side.codec) for layers in sides[1:] for pair in layers for side in pair}
    assert len(codecs) == len(snap.codecs) == 2  # keys' and values' codecs, whatever the layer or restore
    assert sides[1][0][0] is not sides[2][0][0]  # (sides stay per restore: their calibrations are)
    # Plans too: rebuilt from the records by every layer of every restore before, now one per
    # layer's scalars and codec records (layers alike share theirs).
    assert all(a is b for a, b in zip(plans[1], plans[2]))
    assert [p.meta() for p in plans[0]] == [p.meta() for p in plans[2]] == [c.plan.meta() for c in restore(snap)]
    store.close()
