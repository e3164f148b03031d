"""Several processes on one home, and processes killed with SIGKILL in the middle of put and push.

Children are fresh interpreters (never forked: an LMDB environment must not cross fork()). After
the kills, every visible entry (locally and in the bucket) must load and verify, and gc must
reclaim exactly the objects no manifest references.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_store import open_store
from test_store_s3 import bucket_keys, s3_store
from tqstore.format.manifest import Manifest

TESTS = str(Path(__file__).resolve().parent)

PREAMBLE = """
    import random, sys
    sys.path.insert(0, {tests!r})
    from test_blocks import make_snapshot
    from tqstore import Store
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from turboquant.records import Layout

    MODEL = ModelIdentity("weights-a", {{"num_hidden_layers": 2}}, None, None, None, "float16", "synthetic")
    CODEC = CodecIdentity("turbo4", (), {{}})
    BASE = [int(t) for t in __import__("numpy").random.default_rng(0).integers(0, 50_000, 512)]

    def own_tokens(seed, n):
        rng = random.Random(seed)
        return [rng.randrange(50_000) for _ in range(n)]

    def put(store, name, n, seed):
        snap = make_snapshot(512 + n, layouts=[Layout.RAW, Layout.TURBO], seed=6 * (seed % 5))
        store.put(name, snap, BASE + own_tokens(seed, n), model=MODEL, codec=CODEC, model_ref="crash",
                  prefill_seconds=0.1)
""".format(tests=TESTS)

CHAOS = PREAMBLE + """
    home, mode, me, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), eval(sys.argv[4])
    store = Store.open(config=load_config(home, overrides))
    print("ready", flush=True)
    rng = random.Random(me)
    for i in range(10**6):
        name = f"{mode}{me}-{i % 3}"
        put(store, name, rng.choice([88, 300, 600]), me * 1000 + i)
        if mode == "push":
            store.push(name)
            if i == 0:
                print("pushed", flush=True)
"""

WRITER = PREAMBLE + """
    home, me, other = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = Store.open(config=load_config(home, {"min_free_disk_bytes": 0, "segment_size": "64KiB"}))
    seen = set()
    for i in range(8):
        put(store, f"p{me}-{i}", 100 + 50 * i, me * 100 + i)
        for entry in store.ls():  # whatever the other process has published must load whole
            if entry.name.startswith(f"p{other}-"):
                snap, stats = store.load(entry.name)
                assert stats.tokens == snap.offset == entry.tokens
                seen.add(entry.name)
    print(len(seen))
"""


def child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_write_and_read_concurrently(tmp_path):
    home = tmp_path / "home"
    children = [child(WRITER, str(home), str(me), str(1 - me)) for me in (0, 1)]
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
    store = open_store(home)
    names = sorted(e.name for e in store.ls())
    assert names == sorted(f"p{me}-{i}" for me in (0, 1) for i in range(8))
    for entry in store.ls():
        assert store.load(entry.name)[1].tokens == entry.tokens == 512 + 100 + 50 * int(entry.name[3:])
    # every entry starts with the same 512 tokens: both processes share those two blocks
    assert len({store.get(n).blocks[0].key for n in names}) == 1
    assert store.verify() == [] and store.gc().orphans == 0
    store.close()


# 8 children by default (each pays the import of a fresh process); the 20 of the full storm with -m slow.
@pytest.mark.parametrize("children", [8, pytest.param(20, marks=pytest.mark.slow)])
def test_sigkill_during_put_and_push_leaves_only_whole_entries_and_orphans(s3, tmp_path, children):
    home = tmp_path / "home"
    settings = {"min_free_disk_bytes": 0, "segment_size": "64KiB", "s3_url": f"s3://{s3.bucket}/kv",
                "s3_endpoint": s3.endpoint, "s3_region": "us-east-1", "s3_max_attempts": 2, "s3_concurrency": 2}
    rng = random.Random(1234)
    # `children` children, half putting, half putting and pushing; up to six alive at once, so one
    # starting (the import costs seconds) overlaps others working. Each is killed at a random moment
    # of its work: a pusher once its first push is through (so the bucket has entries to check).
    modes = ["put", "push"] * (children // 2)
    waiting, working, kills = list(enumerate(modes)), {}, 0  # working: process -> [mode, kill time]
    while waiting or working:
        while waiting and len(working) < 6:
            me, mode = waiting.pop(0)
            working[child(CHAOS, str(home), mode, str(me), repr(settings))] = [mode, None]
        for p, (mode, kill_at) in list(working.items()):
            if kill_at is None and select.select([p.stdout], [], [], 0)[0]:
                line = p.stdout.readline().strip()
                assert line in ("ready", "pushed"), p.stderr.read()
                if line == "pushed" or mode == "put":
                    working[p][1] = time.monotonic() + rng.uniform(0.05, 0.4)
            elif kill_at is not None and time.monotonic() >= kill_at:
                assert p.poll() is None, p.stderr.read()  # still working when killed
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                p.stdout.close()
                p.stderr.close()
                del working[p]
                kills += 1
        time.sleep(0.01)
    assert kills == children
    store = s3_store(home, s3)
    local = store.ls()
    assert local and any(e.name.startswith("push") for e in local)
    for entry in local:
        snap, stats = store.load(entry.name)
        assert stats.tokens == snap.offset == entry.tokens
    assert store.verify() == []
    remote = store.ls(remote=True)
    assert remote
    fresh = s3_store(tmp_path / "fresh", s3)
    for entry in remote:
        fresh.pull(entry.name)
        assert fresh.load(entry.name)[1].tokens == entry.tokens
    fresh.close()
    stats = store.gc(remote=True, remote_grace=0)
    referenced = {r.key for e in store.ls() for r in store.get(e.name).objects}
    assert set(store._tiers.lmdb.iter_object_keys()) == referenced
    tier = store._tiers.s3
    manifests = [_remote_manifest(store, e.name) for e in remote]
    assert s3.stored(tier) == s3.referenced(tier, manifests) and not bucket_keys(s3)  # no loose objects
    assert store.verify(remote=True) == []
    assert store.verify() == [] and all(store.load(e.name) for e in local)
    print(f"gc reclaimed {stats.orphans} local and {stats.remote_orphans} bucket orphans")
    store.close()


def _remote_manifest(store, name: str) -> Manifest:
    return Manifest.from_bytes(store._tiers.s3.get_manifest(name)[0])
