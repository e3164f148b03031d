"""4 writer and 4 reader processes on one home for a fixed time.

Writers put entries under names every writer shares and never removes (`keep-*`), names every
writer shares and removes (`temp-*`) and names of their own, all over one 512-token prefix, so
blocks are shared and rewritten names race; writer 0 also runs gc. Readers list, restore and
look up prefixes all the while (workers.op_reader says what each restore must give).
Afterwards: no process reported an error, every name that was put and never removed is there,
each entry holds exactly what the put named in its metadata stored (for a writer's own names,
its last put), and the home passes every check (harness.check_home).

Short version: 8 seconds. Long version: max(60, --trials) seconds (default 200).
"""

from __future__ import annotations

import json
import time

import pytest

from harness import check_home, open_store, spawn
from workers import snapshot_digest


def storm(tmp_path, seconds: float, ledger, scenario: str) -> None:
    home = tmp_path / "home"
    open_store(home).close()  # created once, before eight processes race to create it
    base = {"home": str(home), "config": {}, "seconds": seconds}
    procs = [("writer", spawn("writer", {**base, "writer": i, "seed": i})) for i in range(4)]
    procs += [("reader", spawn("reader", {**base, "seed": 100 + i})) for i in range(4)]
    results = {"writer": [], "reader": []}
    deadline = time.monotonic() + seconds + 180
    for role, proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, f"{role} failed:\n{err[-4000:]}"
        assert out.splitlines()[0] == "ready"
        results[role].append(json.loads(out.splitlines()[-1]))
    for reader in results["reader"]:
        assert reader["errors"] == [], reader["errors"]
    puts = [p for w in results["writer"] for p in w["puts"]]
    by_put = {(p["writer"], p["seq"]): p for p in puts}
    store = open_store(home)
    try:
        present = {e.name for e in store.ls()}
        put_names = {p["name"] for p in puts}
        never_removed = {n for n in put_names if not n.startswith("temp-")}
        assert never_removed <= present, f"lost entries: {sorted(never_removed - present)}"
        for name in present:
            manifest = store.get(name)
            made_by = by_put[(int(manifest.metadata["writer"]), int(manifest.metadata["seq"]))]
            assert made_by["name"] == name
            snap, stats = store.load(name)
            assert snapshot_digest(snap) == made_by["digest"], f"{name} does not hold what its put stored"
            if name.startswith("own"):
                last = max((p for p in puts if p["name"] == name), key=lambda p: p["seq"])
                assert (made_by["writer"], made_by["seq"]) == (last["writer"], last["seq"]), f"{name}: a lost update"
        for manifest in (store.get(n) for n in present):
            assert all(store._tiers.lmdb.has_object(r.key) for r in manifest.objects)
    finally:
        store.close()
    found = check_home(home)
    ledger.count(scenario, "processes (4 writers, 4 readers)", 8)
    ledger.count(scenario, "seconds", int(seconds))
    ledger.count(scenario, "puts", len(puts))
    ledger.count(scenario, "rms", sum(len(w["rms"]) for w in results["writer"]))
    ledger.count(scenario, "gcs", sum(w["gcs"] for w in results["writer"]))
    ledger.count(scenario, "loads", sum(r["loads"] for r in results["reader"]))
    ledger.count(scenario, "prefix lookups", sum(r["lookups"] for r in results["reader"]))
    ledger.count(scenario, "loads missed: entry removed or replaced meanwhile",
                 sum(r["gone"] for r in results["reader"]))
    ledger.count(scenario, "reader errors", 0)
    ledger.count(scenario, "entries at the end, each holding what its put stored", found.entries)


def test_four_writers_four_readers(tmp_path, ledger):
    storm(tmp_path, 8, ledger, "concurrency (short)")


@pytest.mark.reliability_long
def test_four_writers_four_readers_long(tmp_path, ledger, trials):
    storm(tmp_path, max(60, trials or 200), ledger, "concurrency (long)")
