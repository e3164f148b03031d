"""What the reliability scenarios share: stores with test settings, child processes, the checks
every fault scenario ends with (the ledger of trials and outcomes is tests/ledger.py).

Children are fresh interpreters running workers.py (never forked: an LMDB environment must not
cross fork()). The checks after a fault are the issue's: `Store.verify()` finds nothing, the
CLI's `tqstore verify --json` agrees (once the CLI is importable), every visible entry loads,
a second gc finds nothing left to reclaim, and py-lmdb's offline `verify` accepts data.mdb.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqstore import Store
from tqstore.config import load_config

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
WORKERS = HERE / "workers.py"

# Fast, deterministic test settings: no free-disk guard (the disk-full scenario sets its own),
# small segments so that objects span several of them.
TEST_SETTINGS = {"min_free_disk_bytes": 0, "segment_size": "64KiB"}


def open_store(home: Path | str, **settings: object) -> Store:
    """A Store on `home` with TEST_SETTINGS overridden by `settings` (Config field names)."""
    return Store.open(config=load_config(home, {**TEST_SETTINGS, **settings}))


def s3_settings(s3, endpoint: str | None = None, **settings: object) -> dict[str, object]:
    """Settings for a Store whose bucket is the test server's (fast retries and timeouts)."""
    return {"s3_url": f"s3://{s3.bucket}/kv", "s3_endpoint": endpoint or s3.endpoint, "s3_region": "us-east-1",
            "s3_max_attempts": 2, "s3_connect_timeout": 2, "s3_read_timeout": 10, **settings}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this one, with the tests folder importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def spawn(op: str, settings: dict[str, object], **extra_env: str) -> subprocess.Popen:
    """workers.py running `op` with `settings` (JSON); stdout is line-buffered text."""
    return subprocess.Popen([sys.executable, str(WORKERS), op, json.dumps(settings)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(**extra_env), cwd=ROOT)


def run_worker(op: str, settings: dict[str, object], timeout: float = 120, **extra_env: str) -> list[dict]:
    """Run workers.py `op` to the end; its JSON output lines (it must exit 0)."""
    proc = spawn(op, settings, **extra_env)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker {op} failed ({proc.returncode}):\n{err[-4000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def lmdb_verify(home: Path | str) -> str:
    """py-lmdb's offline audit of data.mdb (`python -m lmdb verify`); must say OK."""
    path = Path(home) / "lmdb"
    done = subprocess.run([sys.executable, "-m", "lmdb", "verify", "-e", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "verify: OK" in done.stdout, f"lmdb verify {path}:\n{done.stdout}{done.stderr}"
    return done.stdout.strip()


def cli_available() -> bool:
    """Whether the `tqstore` command can be imported (it lives in cli/, built concurrently)."""
    try:
        return importlib.util.find_spec("tqstore_cli.main") is not None
    except ImportError:
        return False


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tqstore ARGV` as a real subprocess (the console script's entry point)."""
    code = "from tqstore_cli.main import run; run()"  # as the console script runs (lazy mlx-lm, no torch)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env or child_env(), cwd=ROOT)


def cli_verify(home: Path | str) -> dict | None:
    """`tqstore verify --home H --json`: exit 0 and a JSON document; None when no CLI exists yet."""
    if not cli_available():
        return None
    done = cli("verify", "--home", str(home), "--json")
    assert done.returncode == 0, f"tqstore verify: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


@dataclass
class HomeCheck:
    """What `check_home` found: entries loaded, objects reclaimed by the first gc, CLI run."""

    entries: int
    reclaimed: int
    cli_checked: bool


def check_home(home: Path | str, **settings: object) -> HomeCheck:
    """The invariants after any fault: verify finds nothing, every visible entry loads whole,
    gc then leaves exactly the referenced objects (a second gc reclaims nothing), LMDB's own
    audit passes, and the CLI's verify agrees. The store is closed again afterwards."""
    store = open_store(home, **settings)
    try:
        assert store.verify() == [], store.verify()
        names = [e.name for e in store.ls()]
        for entry in store.ls():
            snap, stats = store.load(entry.name)
            assert stats.tokens == snap.offset == entry.tokens, entry.name
        first = store.gc()
        second = store.gc()
        assert (second.orphans, second.expired, second.notes) == (0, (), ()), second
        referenced = {r.key for n in names for r in store.get(n).objects}
        assert set(store._tiers.lmdb.iter_object_keys()) == referenced
        assert store.verify() == []
    finally:
        store.close()
    lmdb_verify(home)
    return HomeCheck(len(names), first.orphans, cli_verify(home) is not None)
