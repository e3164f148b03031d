"""The reliability suite's ledger of trials and outcomes, and its report at the end of a run.

It lives beside the root conftest because only the conftests loaded at startup take part in
the run's end: with pytest-xdist the controller loads no conftest below `tests/`, so the
workers send their counts to it (`workeroutput`) and it prints and writes the sum.
"""

from __future__ import annotations

import json
import os
from collections import Counter

WORKER_KEY = "reliability_ledger"


class Ledger:
    """Counts per scenario: trials and each outcome (`count("crash/push", "entries loaded", 3)`)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}

    def count(self, scenario: str, outcome: str, n: int = 1) -> None:
        self.counts.setdefault(scenario, Counter())[outcome] += n

    def add(self, counts: dict[str, dict[str, int]]) -> None:
        """Adds another process's counts (a worker's `plain()`)."""
        for scenario, outcomes in counts.items():
            for outcome, n in outcomes.items():
                self.count(scenario, outcome, n)

    def plain(self) -> dict[str, dict[str, int]]:
        return {scenario: dict(outcomes) for scenario, outcomes in self.counts.items()}

    def lines(self) -> list[str]:
        out = []
        for scenario in sorted(self.counts):
            items = ", ".join(f"{k} {v}" for k, v in sorted(self.counts[scenario].items()))
            out.append(f"{scenario}: {items}")
        return out

    def report(self, terminalreporter, path: str | None) -> None:
        """Prints the counts and, with a path, merges them into that JSON report."""
        if not self.counts:
            return
        terminalreporter.section("reliability: trials and outcomes")
        for line in self.lines():
            terminalreporter.write_line(line)
        if path:
            merged: dict[str, dict[str, int]] = {}
            if os.path.exists(path):  # the short and the long run may write one report
                with open(path) as f:
                    merged = json.load(f)
            merged.update(self.plain())
            with open(path, "w") as f:
                json.dump(merged, f, indent=1, sort_keys=True)


class WorkerCounts:
    """The controller's side of an xdist run: each worker's counts, added as it finishes."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def pytest_testnodedown(self, node, error) -> None:
        self.ledger.add(getattr(node, "workeroutput", {}).get(WORKER_KEY, {}))
