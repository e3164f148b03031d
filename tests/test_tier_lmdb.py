"""The LMDB tier against real environments in tmp_path (no mocks); several processes where it matters."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

import lmdb
import pytest

from tqstore.errors import (ConflictError, CorruptBlock, DiskFull, FormatVersionTooNew, InvalidName, StoreDamaged,
                            TqstoreError)
from tqstore.store.tiers.lmdb import LmdbTier
from tqstore.store.tiers.lmdb_env import check_data_file, next_map_size

SEG = 4096  # a segment holds SEG - 16 payload bytes
PER_SEG = SEG - 16
MiB = 1 << 20


def key(i) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i, size) -> bytes:
    return random.Random(i).randbytes(size)


def open_tier(path, **kw):
    kw = {"segment_size": SEG, "map_size": MiB, "min_free_disk_bytes": 0} | kw
    return LmdbTier.open(path, **kw)


@pytest.fixture
def tier(tmp_path):
    t = open_tier(tmp_path / "lmdb")
    yield t
    t.close()


@contextmanager
def raw_env(path):
    """A plain py-lmdb handle on the tier's files (the tier must be closed: one open per process)."""
    env = lmdb.open(str(path), max_dbs=10)
    try:
        yield env, {n: env.open_db(n) for n in (b"meta", b"objects", b"segments", b"quarantine")}
    finally:
        env.close()


def python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True)


# --- objects ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, PER_SEG - 1, PER_SEG, PER_SEG + 1, 3 * PER_SEG, 3 * PER_SEG + 1, 100_000])
def test_round_trip_is_bit_exact(tier, size):
    data = payload(size, size)
    assert tier.put_object(key(size), data) is True
    assert tier.get_object(key(size)) == data
    info = tier.object_info(key(size))
    assert info.size == size and info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.segment_count == -(-size // PER_SEG) and info.segment_size == PER_SEG
    assert tier.has_object(key(size))


def test_missing_object(tier):
    assert tier.get_object(key("nope")) is None
    assert tier.object_info(key("nope")) is None
    assert not tier.has_object(key("nope"))


def test_read_soon_takes_present_absent_and_many_keys_and_releases_the_map_between_batches(tier, monkeypatch):
    """`read_soon` only advises the kernel: absent keys are skipped, objects read after it are
    the ones stored, and its read transactions are short (a batch of objects each), so a map
    resize is never held up for a whole entry's worth of reads."""
    stored = {key(i): payload(i, 3 * PER_SEG + i) for i in range(20)}
    tier.put_objects(stored)
    opened = []
    real = tier._env.read
    monkeypatch.setattr(tier._env, "read", lambda fn: (opened.append(1), real(fn))[1])
    tier.read_soon([key("absent"), *stored])
    assert len(opened) == 3  # 21 keys, 8 a transaction
    monkeypatch.undo()
    assert all(bytes(tier.read_unhashed(k)[0]) == data for k, data in stored.items())


def test_existing_objects_are_never_rewritten(tier):
    assert tier.put_object(key(1), b"first")
    created = tier.object_info(key(1)).created
    assert tier.put_object(key(1), b"second, longer payload") is False
    assert tier.get_object(key(1)) == b"first"
    assert tier.object_info(key(1)).created == created
    counts = tier.put_objects({key(1): b"third", key(2): b"new"})
    assert counts == (1, 1) and counts.stored == 1 and counts.skipped == 1
    assert tier.get_object(key(1)) == b"first"


def test_keys_must_be_32_bytes(tier):
    with pytest.raises(ValueError, match="32-byte"):
        tier.put_object(b"short", b"x")
    with pytest.raises(ValueError):
        tier.get_object("a" * 32)


def test_delete_touch_and_iterate_across_batches(tier):
    tier.put_objects({key(i): payload(i, 10) for i in range(1100)})  # more than one 1024-key batch
    keys = list(tier.iter_object_keys())
    assert keys == sorted(key(i) for i in range(1100))
    assert tier.touch_objects([key(1), key("absent")], when=123.0) == 1
    assert tier.object_info(key(1)).last_used == 123.0
    assert tier.delete_objects([key(i) for i in range(1000)] + [key("absent")]) == 1000
    assert len(list(tier.iter_object_keys())) == 100
    assert tier.verify() == []  # the segments went with the index entries


def test_concurrent_threads_while_the_map_grows(tier):
    errors = []

    def work(t):
        try:
            for i in range(40):
                n = f"{t}/{i}"
                tier.put_object(key(n), payload(n, 20_000))
                assert tier.get_object(key(n)) == payload(n, 20_000)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.stats().object_count == 160 and tier.stats().map_bytes > MiB


def test_a_payload_given_as_buffers_is_stored_as_their_bytes(tier):
    """Consecutive buffers of any lengths (inside a segment, across segment boundaries, empty)
    are stored as the one payload they make, with its sha256 and the segments of its length."""
    per = SEG - 16
    whole = payload("parts", 5 * per + 123)
    cuts = [0, 10, 10, per - 5, per + 7, 3 * per, 3 * per + 1, len(whole)]
    parts = [memoryview(whole)[a:b] for a, b in zip(cuts, cuts[1:])]
    assert tier.put_objects({key("parts"): parts}).stored == 1
    assert tier.get_object(key("parts")) == whole
    info = tier.object_info(key("parts"))
    assert (info.size, info.sha256, info.segment_count) == (len(whole), hashlib.sha256(whole).hexdigest(), 6)
    assert tier.verify() == []


def test_map_grows_past_a_tiny_initial_size(tier):
    big = payload("big", 5 * MiB)
    tier.put_objects({key(i): payload(i, 300_000) for i in range(20)})
    assert tier.put_object(key("big"), big)
    assert tier.get_object(key("big")) == big
    stats = tier.stats()
    assert stats.map_bytes >= stats.file_bytes > 10 * MiB


def test_next_map_size():
    assert next_map_size(MiB, 0, MiB, 100 * MiB, 0) == 2 * MiB
    assert next_map_size(MiB, 10 * MiB, MiB, 100 * MiB, 0) == 21 * MiB  # room for twice the write
    assert next_map_size(MiB, 0, MiB, 100 * MiB, 99 * MiB + 512 * 1024) == 2 * MiB  # rounded up to MiB
    assert next_map_size(64 * MiB, 0, 64 * MiB, 10 * MiB, 0) == 74 * MiB  # capped by the free disk
    assert next_map_size(64 * MiB, 0, 64 * MiB, 10 * MiB, 10 * MiB) is None  # nothing to grow into


# --- corruption and verification ------------------------------------------------------------------


def damage(path, k, how):
    with raw_env(path) as (env, dbs), env.begin(write=True) as txn:
        seg_key = k + (1).to_bytes(4, "big")
        if how == "flip":
            data = bytearray(txn.get(seg_key, db=dbs[b"segments"]))
            data[7] ^= 0x40
            txn.put(seg_key, bytes(data), db=dbs[b"segments"])
        elif how == "truncate":
            txn.put(seg_key, txn.get(seg_key, db=dbs[b"segments"])[:-1], db=dbs[b"segments"])
        elif how == "drop":
            txn.delete(seg_key, db=dbs[b"segments"])


@pytest.mark.parametrize(
    "how, kind", [("flip", "checksum"), ("truncate", "segment_length"), ("drop", "missing_segment")]
)
def test_corrupt_segment_is_quarantined(tmp_path, how, kind):
    path = tmp_path / "lmdb"
    tier = open_tier(path)
    good = payload(1, 3 * PER_SEG)
    tier.put_objects({key(1): good, key(2): b"neighbour"})
    tier.close()
    damage(path, key(1), how)

    tier = open_tier(path)
    problems = tier.verify()
    assert [(p.kind, p.key) for p in problems] == [(kind, key(1))]
    assert tier.has_object(key(1))  # verify changes nothing
    with pytest.raises(CorruptBlock) as info:
        tier.get_object(key(1))
    assert key(1).hex() in str(info.value) and "quarantined" in str(info.value)
    assert not tier.has_object(key(1)) and tier.get_object(key(1)) is None
    [record] = tier.quarantined()
    assert record.key == key(1) and record.size == len(good) and kind.split("_")[0] in record.reason
    assert tier.stats().quarantine_count == 1
    assert tier.verify() == []  # its segments went too
    assert tier.get_object(key(2)) == b"neighbour"
    assert tier.put_object(key(1), good)  # healed by storing it again
    assert tier.get_object(key(1)) == good and tier.quarantined() == []
    tier.close()


def test_verify_finds_orphan_segments(tmp_path):
    path = tmp_path / "lmdb"
    open_tier(path).close()
    with raw_env(path) as (env, dbs), env.begin(write=True) as txn:
        txn.put(key("ghost") + bytes(4), b"x", db=dbs[b"segments"])
        txn.put(key("ghost") + (1).to_bytes(4, "big"), b"x", db=dbs[b"segments"])
    tier = open_tier(path)
    assert [(p.kind, p.key) for p in tier.verify()] == [("orphan_segment", key("ghost"))]
    tier.close()


def test_newer_layout_is_refused(tmp_path):
    path = tmp_path / "lmdb"
    open_tier(path).close()
    with raw_env(path) as (env, dbs), env.begin(write=True) as txn:
        txn.put(b"schema", b"99", db=dbs[b"meta"])
    with pytest.raises(FormatVersionTooNew, match="upgrade tqstore"):
        open_tier(path)
    with raw_env(path) as (env, dbs):  # the refused open closed its environment again
        pass


# --- manifests and publishing -------------------------------------------------------------------


def test_manifests(tier):
    assert tier.get_manifest("a") is None and tier.list_manifests() == []
    tier.put_manifest("b", b'{"v": 1}')
    tier.put_manifest("a", b"{}")
    tier.put_manifest("b", b'{"v": 2}')
    assert tier.get_manifest("b") == b'{"v": 2}'
    assert [(m.name, m.size) for m in tier.list_manifests()] == [("a", 2), ("b", 8)]
    before = {m.name: m.last_used for m in tier.list_manifests()}
    time.sleep(0.01)
    assert tier.touch("a") is True and tier.touch("zzz") is False
    after = {m.name: m.last_used for m in tier.list_manifests()}
    assert after["a"] > before["a"] and after["b"] == before["b"]
    assert tier.delete_manifest("a") is True and tier.delete_manifest("a") is False
    assert tier.stats().manifest_count == 1
    with pytest.raises(InvalidName):
        tier.put_manifest("../x", b"{}")
    with pytest.raises(InvalidName):
        tier.get_manifest("")


def test_objects_then_the_manifest(tier):
    objects = {key(i): payload(i, 9000) for i in range(3)}
    assert tier.put_objects(objects) == (3, 0)
    tier.put_manifest("entry", b"{}")
    assert tier.get_manifest("entry") == b"{}"
    assert all(tier.get_object(k) == v for k, v in objects.items())


PUBLISH_THEN_DIE = """
    import hashlib, os, signal, sys
    from tqstore.store.tiers.lmdb import LmdbTier
    tier = LmdbTier.open(sys.argv[1], segment_size=4096, map_size=1 << 20, min_free_disk_bytes=0)
    tier.put_manifest = lambda name, data: os.kill(os.getpid(), signal.SIGKILL)  # die between the commits
    tier.put_objects({hashlib.sha256(b"%d" % i).digest(): b"x" * 10000 for i in range(3)})  # committed on return
    tier.put_manifest("entry", b"{}")
"""


def test_killed_between_objects_and_manifest_leaves_only_orphans(tmp_path):
    path = tmp_path / "lmdb"
    child = python(PUBLISH_THEN_DIE, str(path))
    assert child.wait(timeout=30) == -signal.SIGKILL
    tier = open_tier(path)
    assert tier.get_manifest("entry") is None
    assert tier.stats().object_count == 3 and tier.verify() == []
    tier.close()


PUBLISH_FOREVER = """
    import hashlib, json, os, sys
    from tqstore.store.tiers.lmdb import LmdbTier
    tier = LmdbTier.open(sys.argv[1], segment_size=4096, map_size=1 << 20, min_free_disk_bytes=0)
    print("ready", flush=True)
    for n in range(10**6):
        objects = {hashlib.sha256(b"%d/%d" % (n, i)).digest(): os.urandom(5000 * (i + 1)) for i in range(4)}
        tier.put_objects(objects)  # committed before the manifest's own transaction
        tier.put_manifest(f"e{n}", json.dumps([k.hex() for k in objects]).encode())
"""


def test_a_visible_manifest_always_has_its_objects_even_under_kill_9(tmp_path):
    path = tmp_path / "lmdb"
    tier = open_tier(path)
    for round_ in range(3):
        child = python(PUBLISH_FOREVER, str(path))
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + random.uniform(0.2, 0.6)
        while time.monotonic() < deadline:  # read while the other process publishes
            for info in tier.list_manifests():
                for hex_key in json.loads(tier.get_manifest(info.name)):
                    assert tier.get_object(bytes.fromhex(hex_key)) is not None
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    names = [m.name for m in tier.list_manifests()]
    assert names and tier.verify() == []
    for name in names:
        assert all(tier.has_object(bytes.fromhex(h)) for h in json.loads(tier.get_manifest(name)))
    tier.close()


# --- several processes ------------------------------------------------------------------------------

WRITER = """
    import hashlib, random, sys
    from tqstore.store.tiers.lmdb import LmdbTier
    path, me, other = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    key = lambda i: hashlib.sha256(str(i).encode()).digest()
    data = lambda i: random.Random(i).randbytes(1000 + (i * 7919) % 60000)
    tier = LmdbTier.open(path, segment_size=4096, map_size=1 << 20, min_free_disk_bytes=0)
    seen = set()
    for i in range(40):
        tier.put_object(key(me * 1000 + i), data(me * 1000 + i))
        tier.put_manifest(f"p{me}-{i}", b"%d" % i)
        for j in range(40):  # whatever the other process has published so far must be intact
            got = tier.get_object(key(other * 1000 + j))
            if got is not None:
                assert got == data(other * 1000 + j)
                seen.add(j)
    print(len(seen))
"""


def test_two_processes_write_and_read_concurrently(tmp_path):
    path = tmp_path / "lmdb"
    tier = open_tier(path)  # this process holds it open too, with its own (stale) map size
    children = [python(WRITER, str(path), str(me), str(1 - me)) for me in (0, 1)]
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out
    data = lambda i: random.Random(i).randbytes(1000 + (i * 7919) % 60000)  # noqa: E731
    for i in [me * 1000 + j for me in (0, 1) for j in range(40)]:
        assert tier.get_object(key(i)) == data(i)  # adopts the map the children grew
    stats = tier.stats()
    assert stats.object_count == 80 and stats.manifest_count == 80 and tier.verify() == []
    tier.close()


# --- disk space and compaction ------------------------------------------------------------------


def test_free_disk_guard_refuses_writes_and_keeps_earlier_data(tmp_path):
    path = tmp_path / "lmdb"
    tier = open_tier(path)
    tier.put_objects({key(1): b"earlier"})
    tier.put_manifest("kept", b"{}")
    tier.close()
    tier = open_tier(path, min_free_disk_bytes=1 << 62)
    with pytest.raises(DiskFull) as info:
        tier.put_object(key(2), b"x" * 10000)
    message = str(info.value)
    assert "free" in message and "min_free_disk" in message and "tqstore gc" in message and "9.8 KiB" in message
    with pytest.raises(DiskFull):
        tier.put_manifest("new", b"{}")
    assert tier.put_object(key(1), b"existing key: nothing to write") is False  # dedup needs no space
    assert tier.get_object(key(1)) == b"earlier" and tier.get_manifest("kept") == b"{}"
    assert not tier.has_object(key(2)) and tier.get_manifest("new") is None
    assert tier.delete_objects([key(1)]) == 1  # freeing space still works
    tier.close()


def test_compact_shrinks_the_file_and_keeps_data(tier):
    tier.put_objects({key(i): payload(i, 200_000) for i in range(30)})
    tier.put_manifest("m", b"{}")
    tier.delete_objects([key(i) for i in range(27)])
    before = tier.stats()
    result = tier.compact()
    after = tier.stats()
    assert result.bytes_before == before.file_bytes and result.bytes_after == after.file_bytes
    assert after.file_bytes < before.file_bytes / 4
    assert all(tier.get_object(key(i)) == payload(i, 200_000) for i in range(27, 30))
    assert tier.get_manifest("m") == b"{}" and tier.verify() == []
    assert tier.put_object(key("after"), b"still writable")
    assert tier.get_object(key("after")) == b"still writable"


HOLD_OPEN = """
    import sys
    from tqstore.store.tiers.lmdb import LmdbTier
    LmdbTier.open(sys.argv[1], segment_size=4096, map_size=1 << 20)
    print("open", flush=True)
    sys.stdin.read()
"""


def test_compact_is_refused_while_another_process_has_it_open(tier, tmp_path):
    tier.put_object(key(1), b"data")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD_OPEN), str(tier.path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "open"
    with pytest.raises(ConflictError, match=f"process {child.pid} has the LMDB store"):
        tier.compact()
    assert tier.get_object(key(1)) == b"data"
    child.communicate("", timeout=30)
    assert tier.compact().bytes_after > 0
    assert tier.get_object(key(1)) == b"data"


OPEN_ON_CUE = """
    import sys
    from tqstore.store.tiers.lmdb import LmdbTier
    print("ready", flush=True)
    sys.stdin.readline()
    tier = LmdbTier.open(sys.argv[1], segment_size=4096, map_size=1 << 20)
    kept = [bytes.fromhex(k) for k in sys.argv[3:]]
    print(sum(tier.get_object(k) is not None for k in kept), flush=True)
    tier.put_object(bytes.fromhex(sys.argv[2]), b"written beside a compaction")
    tier.close()
"""


def _compact_with_an_opener_at(tier, monkeypatch, target: str, attribute: str, calls_before: int = 0):
    """Compact while a child process opens the store, writes and exits at the moment `target`'s
    `attribute` is called (its call number calls_before + 1); the child's view of the store and
    what the store holds after both are checked."""
    import tqstore.store.tiers.lmdb_env as lmdb_env
    kept = [key(i) for i in range(27, 30)]
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OPEN_ON_CUE), str(tier.path), key("child").hex(),
                              *(k.hex() for k in kept)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    owner = lmdb_env if target == "module" else lmdb_env.LmdbEnv
    real, calls = getattr(owner, attribute), []

    def cue(*args):
        calls.append(1)
        if len(calls) == calls_before + 1:
            child.stdin.write("go\n")
            child.stdin.flush()
            try:  # the child opens, writes and exits in milliseconds unless the compaction holds it off
                child.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return real(*args)

    monkeypatch.setattr(owner, attribute, cue)
    tier.compact()
    monkeypatch.undo()
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.split() == ["3"]  # the child saw every kept object
    assert all(tier.get_object(k) == payload(i, 200_000) for i, k in zip(range(27, 30), kept))
    assert tier.get_object(key("child")) == b"written beside a compaction"
    assert tier.verify() == []


@pytest.mark.parametrize("extra_commit", [False, True])
def test_a_process_opening_the_store_while_compaction_replaces_its_file_waits(tier, monkeypatch, extra_commit):
    """Opened between the replace of data.mdb and the compacting process's reopen, LMDB read the
    copy with the old file's transaction id from lock.mdb: at an even id it saw the copy's empty
    meta page, and its first commit emptied the store (both parities are run)."""
    tier.put_objects({key(i): payload(i, 200_000) for i in range(30)})
    tier.delete_objects([key(i) for i in range(27)])
    if extra_commit:
        tier.put_manifest("flip", b"{}")
    _compact_with_an_opener_at(tier, monkeypatch, "module", "fsync_dir")


def test_a_write_committed_by_another_process_during_the_copy_is_kept(tier, monkeypatch):
    tier.put_objects({key(i): payload(i, 200_000) for i in range(30)})
    tier.delete_objects([key(i) for i in range(27)])
    _compact_with_an_opener_at(tier, monkeypatch, "class", "_refuse_if_shared", calls_before=1)


def test_a_read_only_or_forbidden_folder_is_named_with_what_to_do(tmp_path):
    # What LMDB raises opening a home on a read-only mount or without permission (as root, the
    # test cannot make either happen for real).
    from tqstore.store.tiers.lmdb_env import lmdb_failure
    read_only = lmdb_failure(tmp_path, lmdb.Error(f"{tmp_path}: {os.strerror(30)}"))
    assert "read-only file system" in str(read_only) and "writable --home" in str(read_only)
    denied = lmdb_failure(tmp_path, lmdb.Error(f"{tmp_path}: {os.strerror(13)}"))
    assert "permission denied" in str(denied) and "another --home" in str(denied)


# --- process rules ----------------------------------------------------------------------------------


def test_registry_returns_the_same_instance(tmp_path):
    path = tmp_path / "lmdb"
    tier = open_tier(path)
    os.symlink(path, tmp_path / "alias")
    assert open_tier(path) is tier
    assert LmdbTier.open(tmp_path / "alias") is tier
    assert LmdbTier.open(str(path) + "/.") is tier
    tier.close()
    with pytest.raises(TqstoreError, match="closed"):
        tier.get_object(key(1))
    again = open_tier(path)
    assert again is not tier and again.get_object(key(1)) is None
    again.close()


def test_a_forked_child_is_refused(tier):
    tier.put_object(key(1), b"parent data")
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never run pytest machinery
        code = 0
        for attempt in (lambda: tier.get_object(key(1)), lambda: LmdbTier.open(tier.path)):
            try:
                attempt()
                code = 1
            except TqstoreError as exc:
                code |= 0 if "fork" in str(exc) and "spawn" in str(exc) else 2
            except BaseException:
                code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.get_object(key(1)) == b"parent data"
    assert tier.put_object(key(2), b"still fine")


def _lmdb_file(tmp_path, records: int = 2000):
    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(records):
            txn.put(str(i).encode(), bytes(100))
    size_pages = env.info()["last_pgno"] + 1
    env.close()
    assert (tmp_path / "env" / "data.mdb").stat().st_size == size_pages * 4096  # what the meta page claims
    return tmp_path / "env"


def test_check_data_file_accepts_a_whole_file_and_refuses_a_short_one(tmp_path):
    """Before: a data.mdb shorter than its last commit was mapped as is, and the first read past
    its end killed the process with SIGBUS."""
    path = _lmdb_file(tmp_path)
    check_data_file(path)
    data = path / "data.mdb"
    full = data.read_bytes()
    for size in (len(full) - 1, len(full) // 2, 3 * 4096, 4096 + 100, 100):
        data.write_bytes(full[:size])
        with pytest.raises(StoreDamaged, match="tqstore repair"):
            check_data_file(path)
    data.write_bytes(b"")
    with pytest.raises(StoreDamaged, match="is empty"):  # LMDB writes its meta pages as it creates the file
        check_data_file(path)
    data.write_bytes(bytes(3 * 4096))
    with pytest.raises(StoreDamaged, match="does not start with an LMDB meta page"):
        check_data_file(path)
    data.write_bytes(full + bytes(4096))  # longer is fine: LMDB leaves room past the last page
    check_data_file(path)


def test_a_damaged_schema_record_does_not_stop_the_open(tmp_path):
    """Before: `int(b"x1")` raised ValueError out of every open ("internal error")."""
    tier = LmdbTier.open(tmp_path / "s")
    tier.close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"x1", db=env.open_db(b"meta", txn=txn))
    env.close()
    tier = LmdbTier.open(tmp_path / "s")
    try:
        [record] = tier.damaged_records()
        assert (record.db, record.key) == ("meta", b"schema")
        assert tier.fix_records([record]) == 1 and tier.damaged_records() == []
    finally:
        tier.close()
