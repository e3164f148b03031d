"""A remote gc on one machine and a push on another, overlapping: the push reuses objects of an
entry removed from the bucket (or expired) whose packs are older than the gc's grace, and the gc
must not delete them under it (bucket locks, tqstore/store/bucket_locks.py). Each race is made
deterministic by pausing one side at the worst place, against a real S3 server (moto, `s3`
fixture; it runs in this process, so the tests age objects through its backend)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading

import pytest

from test_blocks import make_snapshot
from test_store import PLAIN, put, token_ids
from test_store_s3 import bucket_keys, s3_store
from tqstore.store import bucket_locks, maintenance, transfer


def _age(s3, hours: float = 2.0) -> None:
    """Make every object of the test bucket look `hours` old (pushed long before the gc's grace)."""
    from moto.s3.models import s3_backends

    for account in s3_backends.values():
        for backend in account.values():
            bucket = backend.buckets.get(s3.bucket)
            for key in [] if bucket is None else bucket.keys.values():
                key.last_modified = key.last_modified - datetime.timedelta(hours=hours)


@pytest.fixture
def fast_locks(monkeypatch):
    monkeypatch.setattr(bucket_locks, "GC_WAIT", 0.05)
    monkeypatch.setattr(bucket_locks, "POLL", 0.05)


def _removed_base_and_longer(s3, tmp_path):
    """Machine A pushed `base` long ago and removed it from the bucket; machine B holds `longer`,
    which shares base's first block and codecs. Returns B's store."""
    tokens = token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "base", make_snapshot(600, layouts=PLAIN), tokens)
    a.push("base")
    a.rm("base", remote=True)
    a.close()
    _age(s3)
    b = s3_store(tmp_path / "b", s3)
    put(b, "longer", make_snapshot(900, layouts=PLAIN, seed=4), tokens[:256] + token_ids(644, seed=1))
    return b


def _pullable(s3, tmp_path, name: str) -> None:
    d = s3_store(tmp_path / "d", s3)
    d.pull(name)
    assert d.verify() == [] and d.verify(remote=True) == []
    d.close()


def _run(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # reported by the test
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_a_gc_during_a_push_removes_nothing_it_reuses(s3, tmp_path, monkeypatch, fast_locks):
    b = _removed_base_and_longer(s3, tmp_path)
    paused, go_on = threading.Event(), threading.Event()
    publish = transfer._publish_manifest

    def slow_publish(*args):  # B's push has sent its objects and map: its manifest write is slow
        paused.set()
        assert go_on.wait(30)
        return publish(*args)

    monkeypatch.setattr(transfer, "_publish_manifest", slow_publish)
    pushing, pushed = _run(lambda: b.push("longer"))
    assert paused.wait(30)
    c = s3_store(tmp_path / "c", s3)
    stats = c.gc(remote=True)  # base's pack is two hours old: past the grace
    assert stats.remote_orphans == 0 and any("in flight" in note for note in stats.notes)
    go_on.set()
    pushing.join(30)
    assert not isinstance(pushed[0], BaseException), pushed[0]
    assert not bucket_keys(s3, "kv/locks/")  # both locks deleted
    _pullable(s3, tmp_path, "longer")
    stats = c.gc(remote=True)  # no push now: what longer does not use goes, what it uses stays
    assert stats.notes == () and stats.remote_maps == 1
    _pullable(s3, tmp_path, "longer")
    b.close()
    c.close()


def test_a_push_during_a_gc_waits_for_it(s3, tmp_path, monkeypatch, fast_locks):
    b = _removed_base_and_longer(s3, tmp_path)
    paused, go_on = threading.Event(), threading.Event()
    in_use = maintenance._packs_in_use

    def slow_packs_in_use(*args):  # the gc has listed the manifests and is about to decide
        paused.set()
        assert go_on.wait(30)
        return in_use(*args)

    monkeypatch.setattr(maintenance, "_packs_in_use", slow_packs_in_use)
    c = s3_store(tmp_path / "c", s3)
    collecting, collected = _run(lambda: c.gc(remote=True))
    assert paused.wait(30)
    pushing, pushed = _run(lambda: b.push("longer"))
    pushing.join(1.0)
    assert pushing.is_alive()  # waiting for the gc's lock
    go_on.set()
    collecting.join(30)
    pushing.join(30)
    assert not isinstance(collected[0], BaseException) and collected[0].remote_orphans == 1  # base's pack
    assert not isinstance(pushed[0], BaseException), pushed[0]
    _pullable(s3, tmp_path, "longer")
    b.close()
    c.close()


def test_a_killed_process_lock_goes_stale(s3, tmp_path, monkeypatch, fast_locks):
    """A lock not rewritten for STALE seconds (its process killed) neither stops a push nor a
    gc, and is deleted by whoever lists it; a live one does."""
    b = _removed_base_and_longer(s3, tmp_path)
    for kind in ("gc", "push"):
        s3.client.put_object(Bucket=s3.bucket, Key=f"kv/locks/{kind}-dead", Body=b"{}")
    _age(s3, hours=bucket_locks.STALE / 3600 + 0.01)
    b.push("longer")
    assert not bucket_keys(s3, "kv/locks/")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {"kind": "push", "time": 0, "machine": bucket_locks._machine(), "pid": int(gone.stdout)}
    s3.client.put_object(Bucket=s3.bucket, Key="kv/locks/push-killed-here", Body=json.dumps(dead).encode())
    stats = b.gc(remote=True, remote_grace=0)  # a lock of a process of this machine that is gone: dead at once
    assert stats.notes == () and not bucket_keys(s3, "kv/locks/")
    s3.client.put_object(Bucket=s3.bucket, Key="kv/locks/push-alive", Body=b"{}")
    stats = b.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and any("in flight" in note for note in stats.notes)
    s3.client.put_object(Bucket=s3.bucket, Key="kv/locks/gc-alive", Body=b"{}")
    monkeypatch.setattr(bucket_locks, "PUSH_WAIT", 0.2)
    with pytest.raises(transfer.ConflictError, match="gc --remote"):
        b.push("longer")
    b.close()
