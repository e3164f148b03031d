"""What `tqstore serve` counts, as Prometheus text (exposition format 0.0.4) from prometheus_client.

The server's own events (requests, tokens, prefix hits, timings, queue, saves) are counted as
they happen, in a registry of this `Metrics` (not the process-wide default one: several
servers in one process count apart); the queue and the store's figures (bytes, objects and
hits per tier, evictions) are read at scrape time. docs/server.md lists every metric.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tqstore.serve.openai_schema import Generation

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TIERS = ("memory", "lmdb", "s3", "none")
SAVE_OUTCOMES = ("saved", "covered", "short", "unsupported", "conflict", "failed")
APIS = ("openai", "anthropic")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RATE_WINDOW_SECONDS = 10.0  # tokens/s is the decode rate over this window


@dataclass(frozen=True)
class QueueState:
    """The model worker's queue at scrape time."""

    waiting: int
    capacity: int
    running: int
    batching: bool = False  # whether generations share decode steps (False: one at a time, in turns)


class Metrics:
    """The counters of one server (thread-safe, as prometheus_client's are)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_, labels, registry=self.registry)

        def seconds(name: str, help_: str) -> Histogram:
            return Histogram(name, help_, buckets=SECONDS_BUCKETS, registry=self.registry)

        self.requests = counter("tqstore_http_requests", "HTTP requests answered, by route, method and status.",
                                ("endpoint", "method", "status"))
        self.prompt_tokens = counter("tqstore_prompt_tokens", "Prompt tokens of finished generations.")
        self.cached_tokens = counter("tqstore_cached_tokens",
                                     "Prompt tokens restored from the store instead of prefilled, per API.", ("api",))
        self.completion_tokens = counter("tqstore_completion_tokens", "Tokens generated.")
        self.prefix_hits = counter("tqstore_prefix_hits", "Generations per API by the slowest tier their stored "
                                   "prefix came from (none: no stored prefix).", ("api", "tier"))
        self.restore = seconds("tqstore_restore_seconds", "Seconds spent restoring a stored prefix (hits only).")
        self.prefill = seconds("tqstore_prefill_seconds", "Seconds spent prefilling the prompt tokens not restored.")
        self.generation = seconds("tqstore_generation_seconds", "Seconds spent decoding after the prefill.")
        self.rejected = counter("tqstore_rejected_requests", "Requests refused with 503 (queue full).")
        self.cancelled = counter("tqstore_cancelled_requests", "Jobs stopped because the client went away.")
        self.saves = counter("tqstore_autosaves", "Save-policy decisions after generations, by outcome.",
                             ("outcome",))
        self.save_seconds = seconds("tqstore_autosave_seconds", "Seconds spent storing new prefixes after responses.")
        self.batch_size = Histogram("tqstore_batch_size", "Generations in each batched decode step.",
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.step_seconds = seconds("tqstore_decode_step_seconds", "Seconds per batched decode step.")
        self.prefill_batch = Histogram("tqstore_prefill_batch_size",
                                       "Requests whose prompts ran in each shared prefill pass.",
                                       buckets=BATCH_BUCKETS, registry=self.registry)
        self._decoded: deque[tuple[float, int]] = deque()  # (when, tokens) of recent decode steps
        self._decoded_lock = threading.Lock()
        for api in APIS:  # listed at 0 before the first of each
            self.cached_tokens.labels(api)
            for tier in TIERS:
                self.prefix_hits.labels(api, tier)
        for outcome in SAVE_OUTCOMES:
            self.saves.labels(outcome)

    def request(self, endpoint: str, method: str, status: int) -> None:
        """One HTTP request answered (`endpoint` is the route template, never the raw path)."""
        self.requests.labels(endpoint, method, str(status)).inc()

    def generated(self, gen: Generation, api: str = "openai") -> None:
        """One finished generation, asked for through `api` (openai or anthropic)."""
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.cached_tokens.labels(api).inc(gen.cached_tokens)
        self.completion_tokens.inc(gen.completion_tokens)
        self.prefix_hits.labels(api, gen.tier).inc()
        if gen.cached_tokens:
            self.restore.observe(gen.restore_seconds)
        self.prefill.observe(gen.prefill_seconds)
        self.generation.observe(gen.generation_seconds)

    def decoded(self, rows: int, seconds: float) -> None:
        """One batched decode step of `rows` generations (one token each)."""
        self.batch_size.observe(rows)
        self.step_seconds.observe(seconds)
        now = time.monotonic()
        with self._decoded_lock:
            self._decoded.append((now, rows))
            while self._decoded and self._decoded[0][0] < now - RATE_WINDOW_SECONDS:
                self._decoded.popleft()

    def prefilled_together(self, rows: int) -> None:
        """One forward pass over the short prefills of `rows` requests."""
        self.prefill_batch.observe(rows)

    def tokens_per_second(self) -> float:
        """Tokens decoded in batched steps over the last RATE_WINDOW_SECONDS, per second."""
        since = time.monotonic() - RATE_WINDOW_SECONDS
        with self._decoded_lock:
            return sum(n for t, n in self._decoded if t >= since) / RATE_WINDOW_SECONDS

    def count_rejected(self) -> None:
        """A request refused because the queue was full."""
        self.rejected.inc()

    def count_cancelled(self) -> None:
        """A job stopped because its client went away."""
        self.cancelled.inc()

    def saved(self, outcome: str, seconds: float | None = None) -> None:
        """One autosave decision: saved, covered, short, unsupported, conflict or failed."""
        self.saves.labels(outcome).inc()
        if seconds is not None:
            self.save_seconds.observe(seconds)

    def render(self, stats, queue: QueueState) -> str:
        """Prometheus text of these counters, `stats` (a StoreStats) and the queue."""
        scrape = CollectorRegistry()
        scrape.register(_Snapshot(stats, queue, self.tokens_per_second()))
        return (generate_latest(self.registry) + generate_latest(scrape)).decode()


class _Snapshot:
    """A collector of figures read at scrape time: the queue and the store's stats."""

    def __init__(self, stats, queue: QueueState, tokens_per_second: float):
        self.stats = stats
        self.queue = queue
        self.tokens_per_second = tokens_per_second

    def collect(self):
        queue = self.queue
        for name, help_, value in (
                ("tqstore_queue_depth", "Requests waiting for the model worker.", queue.waiting),
                ("tqstore_queue_capacity", "Requests that may wait (--max-queue).", queue.capacity),
                ("tqstore_running_jobs", "Jobs the model worker is running (up to --max-running).", queue.running),
                ("tqstore_batching", "1 when generations share batched decode steps, 0 when they take turns.",
                 int(queue.batching)),
                ("tqstore_decode_tokens_per_second", "Tokens decoded in batched steps per second, over the last "
                 f"{RATE_WINDOW_SECONDS:.0f} s.", self.tokens_per_second)):
            yield GaugeMetricFamily(name, help_, value=value)
        stats, tiers = self.stats, self.stats.tiers
        for name, field, help_ in (("tqstore_store_bytes", "bytes", "Bytes held per tier."),
                                   ("tqstore_store_objects", "objects", "Objects (blocks, windows, codecs) held per tier."),
                                   ("tqstore_store_entries", "entries", "Named entries held per tier."),
                                   ("tqstore_store_budget_bytes", "budget", "Byte budget per tier.")):
            family = GaugeMetricFamily(name, help_, labels=("tier",))
            for tier, s in tiers.items():
                if getattr(s, field) is not None:
                    family.add_metric((tier,), getattr(s, field))
            yield family
        hits = CounterMetricFamily("tqstore_store_object_hits", "Objects served by restores per tier.", labels=("tier",))
        for tier, s in tiers.items():
            hits.add_metric((tier,), s.hits)
        yield hits
        for name, help_, value in (
                ("tqstore_store_misses", "Objects a restore found in no tier.", stats.misses),
                ("tqstore_evicted_entries", "Entries evicted for the LMDB budget.", stats.evicted_entries),
                ("tqstore_evicted_objects", "Objects evicted for the LMDB budget.", stats.evicted_objects),
                ("tqstore_evicted_bytes", "Bytes evicted for the LMDB budget.", stats.evicted_bytes),
                ("tqstore_memory_evictions", "Objects dropped from memory for its budget.", stats.memory_evictions)):
            yield CounterMetricFamily(name, help_, value=value)
