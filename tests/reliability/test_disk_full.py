"""A full disk: writes fail with DiskFull, nothing stored before is damaged, space freed inside
the LMDB file is used again, and eviction under a budget keeps the store writable.

Two disks: a real size-limited tmpfs, mounted in a private mount namespace (`unshare -rm`)
where the machine allows it (skipped where it does not), and a simulated small disk that
always runs: the child reports a 12 MiB disk to the free-disk checks (shutil.disk_usage), so
the store's guard and its map growth meet a full disk at the same point on every machine. On
the tmpfs, a ballast file also leaves just less room than LMDB needs for a put whose payload
fits, so LMDB itself meets ENOSPC in the middle of a commit (which LMDB 0.9 reports as EIO).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import pytest

from harness import HERE, ROOT, check_home, child_env, run_worker

CAPACITY = 12 << 20
BUDGET = 5 << 20
CONFIG = {"min_free_disk_bytes": 0, "lmdb_map_size": "1MiB"}


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                           "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True)
    return done.returncode == 0


def check_fill(result: dict, ledger, scenario: str) -> None:
    assert result["other"] == [], result["other"]  # every failure was DiskFull
    assert len(result["full"]) == 3 and all("full" in m or "free" in m for m in result["full"]), result["full"]
    assert result["problems"] == [] and result["loaded"] == result["stored"] > 0
    assert result["after_rm"] == "stored", result["after_rm"]
    assert result["budget_errors"] == [] and result["budget_problems"] == []
    assert result["budget_loaded"] > 0
    ledger.count(scenario, "puts before the disk was full", result["stored"])
    ledger.count(scenario, "puts refused with DiskFull", len(result["full"]))
    ledger.count(scenario, "entries intact after DiskFull (verify, load)", result["loaded"])
    ledger.count(scenario, "put after rm on the full disk", 1)
    ledger.count(scenario, "puts under a budget on the full disk (eviction)", result["budget_puts"])


def test_simulated_small_disk(tmp_path, ledger):
    home = tmp_path / "home"
    [result] = run_worker("fill", {"home": str(home), "config": CONFIG, "simulate_capacity": CAPACITY,
                                   "budget": BUDGET})
    check_fill(result, ledger, "disk full (simulated 12 MiB disk)")
    check_home(home, **CONFIG)


@pytest.mark.skipif(not unshare_works(), reason="no private mount namespace here (unshare -rm)")
def test_size_limited_tmpfs(tmp_path, ledger):
    mount = tmp_path / "disk"
    mount.mkdir()
    home = mount / "home"
    settings = json.dumps({"home": str(home), "config": CONFIG, "budget": BUDGET, "ballast": True})
    python = shlex.quote(sys.executable)
    # Inside the namespace: mount, fill, and run LMDB's own audit before the mount goes away.
    script = (f"mount -t tmpfs -o size={CAPACITY} tmpfs {shlex.quote(str(mount))} && "
              f"{python} {shlex.quote(str(HERE / 'workers.py'))} fill {shlex.quote(settings)} && "
              f"{python} -m lmdb verify -e {shlex.quote(str(home / 'lmdb'))}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    check_fill(result, ledger, "disk full (tmpfs 12 MiB)")
    tight = result["tight"]
    assert tight["after"] == "stored" and tight["problems"] == [], tight
    outcomes = [v for k, v in tight.items() if k.startswith("tight")]
    assert all(v == "stored" or v.startswith("DiskFull") for v in outcomes), outcomes
    assert any(v.startswith("DiskFull") for v in outcomes) and "stored" in outcomes, outcomes
    for outcome in outcomes:
        ledger.count("disk full (tmpfs 12 MiB)", f"put with about its payload free: {outcome}")
    assert "verify: OK" in done.stdout
    ledger.count("disk full (tmpfs 12 MiB)", "lmdb verify passed", 1)
