"""One test per bug the reliability suite found, each failing before its fix (docs/reliability.md
lists them). The scenario tests found them; these pin each one down on its own.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import time

import lmdb
import pytest

from harness import open_store, s3_settings, spawn
from s3_proxy import S3Proxy
from test_blocks import assert_same_snapshot, make_snapshot
from tqstore.format import objects as F
from tqstore.format.blocks import Window
from tqstore.errors import CorruptBlock, DiskFull, TqstoreError
from tqstore.exchange.portable import export_bundle, import_bundle
from tqstore.store.tiers.lmdb_env import lmdb_failure
from workers import LAYOUTS, put

_Usage = collections.namedtuple("_Usage", "total used free")


def small_disk(monkeypatch, home, capacity: int) -> None:
    """The free-disk checks see a disk of `capacity` bytes holding only `home`."""
    def disk_usage(path):
        used = sum(f.stat().st_size for f in home.rglob("*") if f.is_file())
        return _Usage(capacity, used, max(0, capacity - used))

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_a_rm_on_a_full_disk_makes_room_for_the_next_put(tmp_path, monkeypatch):
    """Before: the free-disk guard counted only the disk's free bytes, not the pages the rm
    freed inside data.mdb, and LMDB could not reuse pages freed by the last commit anyway, so
    after DiskFull no put succeeded until the disk was cleaned up by hand."""
    home = tmp_path / "home"
    store = open_store(home)
    for i in range(3):
        put(store, f"e{i}", 600, i)
    small_disk(monkeypatch, home, sum(f.stat().st_size for f in home.rglob("*") if f.is_file()) + 200_000)
    with pytest.raises(DiskFull):
        put(store, "big", 600, 10)
    store.rm("e0")
    put(store, "big", 600, 10)
    assert store.verify() == [] and store.load("big")[1].tokens == 1112
    store.close()


def over_a_lowered_budget_on_a_full_disk(monkeypatch, home, **settings):
    """A store of four entries, opened again with a lower budget than they fill, on a disk with
    100 kB left (less than one more entry)."""
    store = open_store(home, **settings)
    for i in range(4):
        put(store, f"e{i}", 600, i)
    store.close()
    small_disk(monkeypatch, home, sum(f.stat().st_size for f in home.rglob("*") if f.is_file()) + 100_000)
    return open_store(home, lmdb_budget_bytes=1_500_000, **settings)


def test_a_store_over_a_lowered_budget_evicts_before_it_writes(tmp_path, monkeypatch):
    """Before: eviction ran only after a successful put, so on a full disk lowering
    store.lmdb_budget (as the DiskFull message advises) never freed anything."""
    store = over_a_lowered_budget_on_a_full_disk(monkeypatch, tmp_path / "home")
    result = put(store, "new", 600, 10)
    assert result.evicted and "new" in [e.name for e in store.ls()] and store.verify() == []
    store.close()


@pytest.mark.parametrize("how", ["import", "pull"])
def test_an_import_or_pull_into_a_store_over_a_lowered_budget_evicts_before_it_writes(how, tmp_path, monkeypatch,
                                                                                       request):
    """Before: import_bundle published its objects by its own copy of the put path, without the
    eviction that put and pull run before they write, so on a full disk lowering the budget
    never let an import in (put, pull and import now share store/publish.py)."""
    settings = s3_settings(request.getfixturevalue("s3")) if how == "pull" else {}
    source = open_store(tmp_path / "source", **settings)
    put(source, "doc", 600, 10)
    if how == "pull":
        source.push("doc")
    else:
        export_bundle(source, "doc", tmp_path / "doc.tqb")
    source.close()
    store = over_a_lowered_budget_on_a_full_disk(monkeypatch, tmp_path / "home", **settings)
    result = store.pull("doc") if how == "pull" else import_bundle(store, tmp_path / "doc.tqb")
    assert result.evicted and "doc" in [e.name for e in store.ls()] and store.verify() == []
    assert store.load("doc")[1].tokens == 1112
    store.close()


def test_lmdb_reports_a_full_disk_as_an_io_error_and_it_is_disk_full(tmp_path):
    """Before: LMDB 0.9 turns the short write of a full disk into EIO ("mdb_txn_commit:
    Input/output error"), which surfaced as a generic TqstoreError, not DiskFull."""
    error = lmdb.Error("mdb_txn_commit: Input/output error")
    assert isinstance(lmdb_failure(tmp_path, error, needed=1 << 60), DiskFull)  # more than any disk holds
    other = lmdb_failure(tmp_path, error, needed=0)  # a disk with room: a real I/O error
    assert type(other) is TqstoreError and "Input/output error" in str(other)
    assert isinstance(lmdb_failure(tmp_path, lmdb.Error("mdb_put: Disk quota exceeded")), DiskFull)


def test_objects_that_verify_but_do_not_fit_their_entry_are_quarantined(tmp_path):
    """Before: a window rewritten with another layer config (its frame and digests recomputed,
    so it passes every check of its own) made every load fail with 'do not fit together',
    without naming it, without quarantining it, and it stayed in the memory tier."""
    store = open_store(tmp_path / "home")
    result = put(store, "a", 600, 1)
    window = result.manifest.window.key
    tier = store._tiers.lmdb
    payload = tier.get_object(window)
    header = F.inspect(payload)
    obj = F.loads(payload, expect=F.Expect())
    layers = [dataclasses.replace(r, config={**r.config, "ratio": 0.5}) if r.per_token and r.config.get("ratio")
              else r for r in obj.layers]
    tier.delete_objects([window])
    tier.put_objects({window: F.dumps(Window(layers), header.provenance)})
    store._tiers.memory.drop([window])
    with pytest.raises(CorruptBlock, match=f"window {window.hex()[:12]} is not the copy any entry recorded"):
        store.load("a")
    assert window in {r.key for r in tier.quarantined()} and not store._tiers.memory.has(window)
    assert not tier.has_object(window)
    put(store, "a", 600, 1)  # saving again heals it
    assert_same_snapshot(store.load("a")[0], result.snapshot)
    assert store.verify() == []
    store.close()


def test_synthetic_layers_have_a_ratio_to_change():
    """The misfit test above changes `ratio` in a TurboQuant layer's config: make sure there is one."""
    snap = make_snapshot(10, layouts=LAYOUTS)
    assert any(r.config.get("ratio") for r in snap.layers)


def test_one_damaged_manifest_in_the_bucket_hides_no_other(s3, tmp_path):
    """Before: a bucket manifest failing its sha256 raised CorruptBlock out of the listing, so
    `ls --remote` failed and the remote index stopped refreshing: no remote entry was found."""
    store = open_store(tmp_path / "origin", **s3_settings(s3))
    for name, seed in (("a", 1), ("b", 2)):
        put(store, name, 300, seed)
        store.push(name)
    tokens, model, codec = store.get("a").tokens, store.get("a").model_digest, store.get("a").codec_digest
    store.close()
    key = "kv/manifests/b.json"
    got = s3.client.get_object(Bucket=s3.bucket, Key=key)
    body = got["Body"].read()
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body.replace(b'"pinned":false', b'"pinned":true '),
                         Metadata=got["Metadata"])
    reader = open_store(tmp_path / "reader", **s3_settings(s3))
    assert [e.name for e in reader.ls(remote=True)] == ["a"]
    match = reader.lookup(list(tokens) + [1], model=model, codec=codec)
    assert match is not None and match.remote and match.manifest.name == "a"
    with pytest.raises(CorruptBlock, match="failed verification"):
        reader.pull("b")
    stats = reader.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and "b" in stats.notes[0]
    reader.close()


def test_a_push_whose_manifest_answer_was_lost_is_still_ours(s3, tmp_path):
    """Before: when the answer to the manifest PUT was lost after the write (or the process died
    right then), the retried conditional PUT got 412 and the push failed with ConflictError
    ("another machine pushed first"), the new etag was never recorded, and every later push of
    that entry, re-saved, failed with ConflictError too."""
    proxy = S3Proxy(s3.endpoint)
    try:
        store = open_store(tmp_path / "home", **s3_settings(s3, proxy.endpoint, s3_read_timeout=1.0,
                                                            s3_max_attempts=3))
        put(store, "a", 300, 1)
        proxy.inject("late", method="PUT", kind="manifest", times=1, delay=1.6)
        store.push("a")  # the write happened, its answer did not come
        put(store, "a", 600, 2)  # saved again: the bucket's version is this entry's ancestor
        proxy.inject("late", method="PUT", kind="manifest", times=1, delay=1.6)
        store.push("a")
        put(store, "a", 44, 3)
        store.push("a")
        fresh = open_store(tmp_path / "fresh", **s3_settings(s3))
        fresh.pull("a")
        assert fresh.load("a")[1].tokens == 556
        fresh.close()
        store.close()
    finally:
        proxy.stop()


def test_a_push_killed_after_its_manifest_write_can_push_again(s3, tmp_path):
    """Before: a push killed after the bucket took its manifest, before the new etag was recorded
    locally, left the old etag behind; the entry, saved again, could never be pushed again
    (ConflictError: "the bucket already holds a different entry"). The crash storm found it."""
    proxy = S3Proxy(s3.endpoint)
    try:
        settings = s3_settings(s3, proxy.endpoint)
        home = tmp_path / "home"
        proxy.inject("late", method="PUT", kind="manifest", delay=60)  # the write lands; the answer never comes
        child = spawn("push", {"home": str(home), "config": settings, "seed": 5})
        deadline = time.monotonic() + 120
        while proxy.count("PUT", "manifest", "late") == 0:
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read() if child.poll() else ""
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stderr.close()
        proxy.clear()
        name = next(r.path for r in proxy.records if r.outcome.startswith("late")).rsplit("/", 1)[1][:-5]
        store = open_store(home, **settings)
        assert store._tiers.s3.get_manifest(name) is not None  # the bucket took it
        put(store, name, 44, 99)  # saved again, then pushed: the bucket's version is this entry's own
        store.push(name)
        assert json.loads(store._tiers.s3.get_manifest(name)[0])["tokens"] == list(store.get(name).tokens)
        store.close()
    finally:
        proxy.stop()


def test_the_copy_of_a_killed_compaction_is_removed(tmp_path):
    """Before: a gc --compact killed during its copy left `.data.mdb.<random>.compact` (as large
    as the live data) in the LMDB folder for good. The crash storm found it."""
    store = open_store(tmp_path / "home")
    put(store, "a", 300, 1)
    store.close()
    stale = tmp_path / "home" / "lmdb" / ".data.mdb.0123456789ab.compact"
    stale.write_bytes(b"\0" * 4096)
    store = open_store(tmp_path / "home")  # alone: the leftover goes at open
    assert not stale.exists()
    stale.write_bytes(b"\0" * 4096)
    store.gc(compact=True)  # and at the next compaction
    assert not stale.exists() and store.load("a")[1].tokens == 812
    store.close()


def test_a_pin_from_another_process_reaches_a_running_store(tmp_path):
    """Before: a process read the pins once (a server at its first restore), so a `tqstore pin`
    beside it never kept that entry's objects in its memory tier (nor did an unpin let them go)."""
    from harness import cli

    home = tmp_path / "home"
    store = open_store(home)
    try:
        put(store, "a", 44, 1)
        assert store.tiers.memory.stats().pinned_bytes == 0
        done = cli("pin", "a", "--home", str(home))
        assert done.returncode == 0, done.stderr
        time.sleep(1.1)  # tierset.PINS_MAX_AGE
        put(store, "b", 44, 2)  # any put or restore looks at the pins again once they are that old
        assert store.tiers.memory.stats().pinned_bytes > 0
        assert cli("unpin", "a", "--home", str(home)).returncode == 0
        time.sleep(1.1)
        store.load("b")
        assert store.tiers.memory.stats().pinned_bytes == 0
    finally:
        store.close()
