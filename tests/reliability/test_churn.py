"""save/rm cycles of varied sizes in one long-running process (workers.py churn).

Entries of 513 to 3512 tokens over 8 layers (the production segment size, 1 MiB), at most 8
alive, each cycle a save or an rm. The LMDB file must stay under 1.5 times the peak live
payload (the bound that decides whether payloads stay inside LMDB; docs/reliability.md, "Churn"),
`gc(compact=True)` must bring it back to the live data, and the process's memory (RSS, and
MLX's active memory) must stay flat once warm.

Short version: 100 cycles. Long version: max(500, --trials) cycles.
"""

from __future__ import annotations

import pytest

from harness import check_home, run_worker

MiB = 1 << 20
CONFIG = {"segment_size": "1MiB", "memory_budget_bytes": "64MiB"}


def churn(tmp_path, cycles: int, ledger, scenario: str) -> None:
    home = tmp_path / "home"
    [r] = run_worker("churn", {"home": str(home), "config": CONFIG, "cycles": cycles, "max_live": 8, "seed": 7,
                               "layers": 4}, timeout=1800)
    assert r["problems"] == [] and r["loaded"] == r["live"]
    ratio = r["peak_file"] / r["peak_live"]
    assert ratio <= 1.5, f"data.mdb reached {ratio:.2f}x the peak live data ({r['peak_file']} / {r['peak_live']})"
    assert r["file_after"] <= 1.1 * r["live_after"] + MiB, r  # compaction leaves the live data and page slack
    samples = r["samples"]
    warm = samples[len(samples) // 5:]
    first, last = max(s["rss_now"] for s in warm[:len(warm) // 2]), warm[-1]["rss_now"]
    assert last <= 1.05 * first + 16 * MiB, f"RSS grew from {first} to {last} bytes over the cycles"
    assert max(s["active"] for s in warm) <= 2 * 64 * MiB  # MLX arrays: the memory tier's budget bounds them
    ledger.count(scenario, "save/rm cycles", cycles)
    ledger.count(scenario, "peak live payload (KiB)", r["peak_live"] // 1024)
    ledger.count(scenario, "peak data.mdb (KiB)", r["peak_file"] // 1024)
    ledger.count(scenario, "peak data.mdb / peak live (x100)", round(100 * ratio))
    ledger.count(scenario, "data.mdb after gc --compact (KiB)", r["file_after"] // 1024)
    ledger.count(scenario, "live payload after the cycles (KiB)", r["live_after"] // 1024)
    ledger.count(scenario, "RSS once warm (MiB)", first // MiB)
    ledger.count(scenario, "RSS at the end (MiB)", last // MiB)
    check_home(home, **CONFIG)


def test_churn_keeps_the_file_and_the_memory_bounded(tmp_path, ledger):
    churn(tmp_path, 100, ledger, "churn (short)")


@pytest.mark.reliability_long
def test_churn_long(tmp_path, ledger, trials):
    churn(tmp_path, max(500, trials or 0), ledger, "churn (long)")
