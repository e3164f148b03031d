"""SIGKILL a writer at a random moment of save (the engine), push, pull, gc and eviction.

After each kill: `Store.verify()` finds nothing, every visible entry loads whole, a second gc
reclaims nothing (the first took the killed writer's orphans), py-lmdb's offline audit accepts
the file, and `tqstore verify --json` agrees when the CLI is importable (harness.check_home).
For push and pull the bucket is checked too: every manifest in it pulls into an empty home and
loads, and a remote gc leaves exactly the referenced objects.

Short version: two kills per operation. Long version: --trials kills in all (default 200).
"""

from __future__ import annotations

import os
import random
import select
import signal
import time
from pathlib import Path

import pytest

from harness import check_home, open_store, s3_settings, spawn
from model_folder import write_model_folder
from tqstore.format.manifest import Manifest
from tqstore.store.tiers.lmdb_env import OPEN_LOCK

# Seconds after "ready" within which the kill lands: about two iterations of each operation, so
# kills fall into every phase (object writes, manifest, eviction, compaction, HTTP requests).
WINDOWS = {"save": 2.0, "push": 1.2, "pull": 1.0, "gc": 1.0, "evict": 1.0}
BUDGET = 600_000  # bytes: an eviction after nearly every put of the evict op


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("crash-model") / "tiny-qwen2", kind="qwen2")


def seed_bucket(s3, tmp_path: Path) -> None:
    """Three entries in the bucket for the pull op to fetch again and again."""
    store = open_store(tmp_path / "seed", **s3_settings(s3))
    from workers import put

    for i, n in enumerate((44, 300, 600)):
        put(store, f"r{i}", n, 1000 + i)
        store.push(f"r{i}")
    store.close()


def kill_at_random(op: str, settings: dict, rng: random.Random) -> float:
    """Start `op`, wait for "ready", SIGKILL it after a random delay; returns the delay. The
    child must still be working when killed (an exception before is a finding)."""
    proc = spawn(op, settings)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().strip() if ready else ""
        assert line == "ready", f"{op} did not start: {line!r}\n{proc.stderr.read() if proc.poll() is not None else ''}"
        delay = rng.uniform(0.0, WINDOWS[op])
        time.sleep(delay)
        assert proc.poll() is None, f"{op} died before the kill:\n{proc.stderr.read()[-4000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        return delay
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def check_bucket(s3, tmp_path: Path, ledger, scenario: str) -> None:
    """Every manifest in the bucket pulls into an empty home and loads; a remote gc then
    leaves exactly the objects the manifests reference."""
    home = tmp_path / f"fresh-{time.monotonic_ns()}"
    store = open_store(home, **s3_settings(s3))
    try:
        remote = store.ls(remote=True)
        for entry in remote:
            store.pull(entry.name)
            snap, stats = store.load(entry.name)
            assert stats.tokens == snap.offset == entry.tokens
        store.gc(remote=True, remote_grace=0)
        tier = store._tiers.s3
        manifests = [Manifest.from_bytes(tier.get_manifest(entry.name)[0]) for entry in remote]
        assert s3.stored(tier) == s3.referenced(tier, manifests) and store.verify(remote=True) == []
        ledger.count(scenario, "bucket entries pulled and loaded", len(remote))
    finally:
        store.close()


def crash_trials(op: str, n: int, tmp_path: Path, ledger, scenario: str, rng: random.Random, s3=None,
                 model_dir: Path | None = None) -> None:
    """`n` kills of `op` on one home, each followed by every check."""
    home = tmp_path / f"{op}-home"
    config: dict[str, object] = {}
    if op in ("push", "pull"):
        config = s3_settings(s3)
    if op == "evict":
        config = {"lmdb_budget_bytes": BUDGET}
    settings = {"home": str(home), "config": config}
    if op == "save":
        settings.update(model=str(model_dir), scheme="turbo4")
    for trial in range(n):
        settings["seed"] = rng.randrange(10**9)
        delay = kill_at_random(op, settings, rng)
        found = check_home(home, **config)
        ledger.count(scenario, f"{op}: SIGKILLs")
        ledger.count(scenario, f"{op}: entries verified and loaded after the kills", found.entries)
        ledger.count(scenario, f"{op}: orphans reclaimed by gc", found.reclaimed)
        ledger.count(scenario, "tqstore verify --json (CLI) passed", int(found.cli_checked))
        ledger.count(scenario, "lmdb verify passed")
        if op in ("push", "pull"):
            check_bucket(s3, tmp_path, ledger, scenario)
        leftovers = [p.name for p in (home / "lmdb").iterdir() if p.name not in ("data.mdb", "lock.mdb", OPEN_LOCK)]
        assert leftovers == [], f"files left in the LMDB folder after a kill {delay:.2f}s into {op}: {leftovers}"


@pytest.mark.parametrize("op", list(WINDOWS))
def test_sigkill_leaves_a_consistent_store(op, tmp_path, s3, model_dir, ledger):
    rng = random.Random(f"crash-{op}")
    if op == "pull":
        seed_bucket(s3, tmp_path)
    crash_trials(op, 2, tmp_path, ledger, "crash (short)", rng, s3=s3, model_dir=model_dir)


@pytest.mark.reliability_long
def test_sigkill_storm(tmp_path, s3, model_dir, ledger, trials):
    total = trials or 200
    rng = random.Random("crash-storm")
    seed_bucket(s3, tmp_path)
    per_op = -(-total // len(WINDOWS))
    for op in WINDOWS:
        crash_trials(op, per_op, tmp_path, ledger, "crash (long)", rng, s3=s3, model_dir=model_dir)
