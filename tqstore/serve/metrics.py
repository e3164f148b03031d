"""What `tqstore serve` counts, rendered as Prometheus text (exposition format 0.0.4).

The server's own events (requests, tokens, prefix hits, timings, queue, saves) are counted here
as they happen; the store's figures (bytes, objects and hits per tier, evictions) are read from
`Store.stats()` at scrape time. docs/server.md lists every metric.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from tqstore.serve.openai_schema import Generation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    """Cumulative buckets, sum and count of observed values (not thread-safe: Metrics locks)."""

    def __init__(self, buckets: tuple[float, ...] = SECONDS_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_number(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_number(self.sum)}",
                      f"{name}_count {self.count}"]


@dataclass(frozen=True)
class QueueState:
    """The model worker's queue at scrape time."""

    waiting: int
    capacity: int
    running: int


class Metrics:
    """Thread-safe counters of one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (endpoint, method, status)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prefix_hits: Counter[str] = Counter()  # tier (or "none") -> generations
        self.restore = Histogram()
        self.prefill = Histogram()
        self.generation = Histogram()
        self.rejected = 0
        self.cancelled = 0
        self.saves: Counter[str] = Counter()  # autosave outcome -> count
        self.save_seconds = Histogram()

    def request(self, endpoint: str, method: str, status: int) -> None:
        """One HTTP request answered (`endpoint` is the route template, never the raw path)."""
        with self._lock:
            self.requests[(endpoint, method, status)] += 1

    def generated(self, gen: Generation) -> None:
        """One finished generation."""
        with self._lock:
            self.prompt_tokens += gen.prompt_tokens
            self.cached_tokens += gen.cached_tokens
            self.completion_tokens += gen.completion_tokens
            self.prefix_hits[gen.tier] += 1
            if gen.cached_tokens:
                self.restore.observe(gen.restore_seconds)
            self.prefill.observe(gen.prefill_seconds)
            self.generation.observe(gen.generation_seconds)

    def count_rejected(self) -> None:
        """A request refused because the queue was full."""
        with self._lock:
            self.rejected += 1

    def count_cancelled(self) -> None:
        """A job stopped because its client went away."""
        with self._lock:
            self.cancelled += 1

    def saved(self, outcome: str, seconds: float | None = None) -> None:
        """One autosave decision: saved, covered, short, unsupported or failed."""
        with self._lock:
            self.saves[outcome] += 1
            if seconds is not None:
                self.save_seconds.observe(seconds)

    def render(self, stats, queue: QueueState) -> str:
        """Prometheus text of these counters, `stats` (a StoreStats) and the queue."""
        with self._lock:
            lines = self._own_lines(queue)
        lines += _store_lines(stats)
        return "\n".join(lines) + "\n"

    def _own_lines(self, queue: QueueState) -> list[str]:
        out: list[str] = []
        metric = _Writer(out)
        requests = sorted(self.requests.items())
        metric("tqstore_http_requests_total", "counter", "HTTP requests answered, by route, method and status",
               ((f'endpoint="{_label(e)}",method="{m}",status="{s}"', n) for (e, m, s), n in requests))
        metric("tqstore_prompt_tokens_total", "counter", "prompt tokens of finished generations",
               [("", self.prompt_tokens)])
        metric("tqstore_cached_tokens_total", "counter", "prompt tokens restored from the store instead of prefilled",
               [("", self.cached_tokens)])
        metric("tqstore_completion_tokens_total", "counter", "tokens generated", [("", self.completion_tokens)])
        metric("tqstore_prefix_hits_total", "counter",
               "generations by the slowest tier their stored prefix came from (none: no stored prefix)",
               ((f'tier="{t}"', self.prefix_hits[t]) for t in ("memory", "lmdb", "s3", "none")))
        for name, hist, help_ in (
                ("tqstore_restore_seconds", self.restore, "restoring a stored prefix (hits only)"),
                ("tqstore_prefill_seconds", self.prefill, "prefilling the prompt tokens not restored"),
                ("tqstore_generation_seconds", self.generation, "decoding after the prefill")):
            out += [f"# HELP {name} Seconds spent {help_}.", f"# TYPE {name} histogram", *hist.lines(name)]
        metric("tqstore_queue_depth", "gauge", "requests waiting for the model worker", [("", queue.waiting)])
        metric("tqstore_queue_capacity", "gauge", "requests that may wait (--max-queue)", [("", queue.capacity)])
        metric("tqstore_running_jobs", "gauge", "jobs the model worker is running (taking turns, up to --max-running)", [("", queue.running)])
        metric("tqstore_rejected_requests_total", "counter", "requests refused with 503 (queue full)",
               [("", self.rejected)])
        metric("tqstore_cancelled_requests_total", "counter", "jobs stopped because the client went away",
               [("", self.cancelled)])
        metric("tqstore_autosaves_total", "counter", "save-policy decisions after generations, by outcome",
               ((f'outcome="{o}"', self.saves[o]) for o in ("saved", "covered", "short", "unsupported", "failed")))
        out += ["# HELP tqstore_autosave_seconds Seconds spent storing new prefixes after responses.",
                "# TYPE tqstore_autosave_seconds histogram", *self.save_seconds.lines("tqstore_autosave_seconds")]
        return out


def _store_lines(stats) -> list[str]:
    out: list[str] = []
    metric = _Writer(out)
    tiers = stats.tiers
    for name, field, help_ in (("tqstore_store_bytes", "bytes", "bytes held"),
                               ("tqstore_store_objects", "objects", "objects (blocks, windows, codecs) held"),
                               ("tqstore_store_entries", "entries", "named entries held"),
                               ("tqstore_store_budget_bytes", "budget", "byte budget")):
        metric(name, "gauge", f"{help_} per tier", ((f'tier="{t}"', getattr(s, field)) for t, s in tiers.items()
                                                    if getattr(s, field) is not None))
    metric("tqstore_store_object_hits_total", "counter", "objects served by restores per tier",
           ((f'tier="{t}"', s.hits) for t, s in tiers.items()))
    metric("tqstore_store_misses_total", "counter", "objects a restore found in no tier", [("", stats.misses)])
    metric("tqstore_evicted_entries_total", "counter", "entries evicted for the LMDB budget",
           [("", stats.evicted_entries)])
    metric("tqstore_evicted_objects_total", "counter", "objects evicted for the LMDB budget",
           [("", stats.evicted_objects)])
    metric("tqstore_evicted_bytes_total", "counter", "bytes evicted for the LMDB budget", [("", stats.evicted_bytes)])
    metric("tqstore_memory_evictions_total", "counter", "objects dropped from memory for its budget",
           [("", stats.memory_evictions)])
    return out


class _Writer:
    def __init__(self, out: list[str]):
        self.out = out

    def __call__(self, name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
        self.out += [f"# HELP {name} {help_[0].upper()}{help_[1:]}.", f"# TYPE {name} {kind}"]
        self.out += [f"{name}{{{labels}}} {_number(v)}" if labels else f"{name} {_number(v)}" for labels, v in samples]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
