"""The model side of `tqstore serve`: one owner thread, a bounded job queue, continuous
batching of the running jobs, cancellation and the save policy.

MLX work (loading, tokenizing, prefill, decode, compress, store) happens only on the worker's
thread; the HTTP layer submits jobs and gets each job's events (Accepted, Text, Finished,
Failed) through the job's `sink`, called on the worker's thread. Up to `max_running` jobs run at
once. A job is a generator: it yields None after a step of its own (a prefill chunk, a token of
a family that cannot batch) and a `Row` when it waits for its next token from a shared decode
step (tqstore/engine/batch.py). Each cycle of the worker runs steps of the jobs not waiting on a
Row, least model time first, while they fit in CHUNK_SECONDS, then one batched decode step over
every job waiting on a Row (joining and leaving between steps), so a long prompt's prefill
chunks (sized by chunking.py) interleave with the running decode, and a new request's prefill
and first token go before a long one's next chunk. A running job that has
had HOLD_SECONDS of model time while others wait is parked: it keeps its state and goes to the
back of the line, and the job that waited longest takes its place, so no request waits for the
running ones to end. A client that goes away cancels its job: a queued job is skipped, a
running one stops at its next token (the engine's `stop` callback). After a response is
complete the worker compresses the new prefix (the save policy) at the end of the job's last
step and hands it to a background writer (background.py), which serializes and
stores it while the worker takes the next request; a request whose prompt extends a prefix
still being written waits for that write only, so it finds the prefix stored.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from turboquant import make_prompt_cache
from turboquant.checkpoints import StateCheckpoints

from tqstore.engine.background import BackgroundWriter
from tqstore.engine.batch import DecodeBatch, Row, batchable, batched_generation
from tqstore.engine.chunks import Document
from tqstore.engine.defaults import DEFAULT_RECOMPUTE
from tqstore.engine.engine import Engine
from tqstore.engine.prefill import Started
from tqstore.errors import BadInput, TqstoreError
from tqstore.models.loading import LoadedModel
from tqstore.serve.chunking import CHUNK_SECONDS, ChunkSizer
from tqstore.serve.metrics import Metrics, QueueState
from tqstore.serve.openai_schema import ApiError, CacheSource, Generation, GenerationRequest, StopScanner, api_error
from tqstore.models.prompting import encode_prompt

log = logging.getLogger("tqstore.serve")
AUTO_PREFIX = "auto-"
HOLD_SECONDS = 1.0  # model time a job runs for, once admitted, before it yields its place to a waiting one
UNKNOWN_CONTEXT_TOKENS = 32768  # the token cap of a model whose config names no context length
_CONTEXT_FIELDS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length", "n_ctx")


# --- events a job sends to the HTTP handler that waits for it ----------------------------------

@dataclass(frozen=True)
class Accepted:
    """The prompt's stored prefix is restored and generation starts (a stream may send its
    headers, which say where the prompt came from)."""

    prompt_tokens: int
    cached_tokens: int = 0
    tier: str = "none"


@dataclass(frozen=True)
class Text:
    """More answer text, safe to send (stop sequences already cut)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The job's result: a Generation, or the EntryInfo of a saved cache."""

    value: Any


@dataclass(frozen=True)
class Failed:
    """The job failed; `error` is what the client gets."""

    error: ApiError


Event = Accepted | Text | Finished | Failed
Sink = Callable[[Event], None]


@dataclass
class Job:
    """One unit of model work and the channel back to the HTTP handler waiting for it."""

    kind: str  # "generate" or "save"
    work: Callable[[Job], Iterator[Row | None]]  # a generator: it yields where the worker may switch jobs
    sink: Sink  # takes the job's events, on the worker's thread: it must not block
    cancelled: threading.Event = field(default_factory=threading.Event)
    step_seconds: float = 0.0  # model time of its last own step (a prefill chunk, say)

    def send(self, event: Event) -> None:
        self.sink(event)

    def cancel(self) -> None:
        """The client went away: skip the job, or stop it at its next token."""
        self.cancelled.set()


@dataclass(eq=False)
class Running:
    """A job the worker has started: its remaining steps, the decode row it waits on (None: it
    waits for a step of its own) and the model time it has used."""

    job: Job
    steps: Iterator[Row | None]
    pending: Row | None = None
    seconds: float = 0.0
    held: float = 0.0  # model time since it was last admitted


class QueueFull(Exception):
    """The queue is full; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: retry after {retry_after} s")
        self.retry_after = retry_after


# --- the save policy ------------------------------------------------------------------------

@dataclass(frozen=True)
class SavePolicy:
    """Which prompts are stored after their response: at least `min_tokens` long, not already
    covered by a stored prefix; as `auto-<hash>` entries that expire after `ttl` seconds."""

    enabled: bool = True
    min_tokens: int = 256
    ttl: float | None = 24 * 3600.0

    @staticmethod
    def name_for(model_digest: bytes, scheme: str, tokens: Sequence[int]) -> str:
        """A deterministic entry name: the same prefix on the same model and scheme, the same name."""
        h = hashlib.sha256(model_digest + scheme.encode() + b"\0")
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
        return AUTO_PREFIX + h.hexdigest()[:16]


# --- prompts as mlx-lm's server tokenizes them -----------------------------------------------

# mlx-lm's role prefixes for tokenizers without a chat template (its server's convert_chat).
_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}

def completion_tokens(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """A completions prompt: token ids as given; text with special tokens unless it already
    starts with the BOS token (as mlx-lm's generate)."""
    if not isinstance(prompt, str):
        return list(prompt)
    return encode_prompt(tokenizer, prompt)


def chat_tokens(tokenizer, messages: Sequence[dict], tools: Sequence[Any] | None = None) -> list[int]:
    """Chat messages through the tokenizer's chat template with the generation prompt, as
    mlx-lm's server; a tokenizer without a template gets mlx-lm's plain role prefixes."""
    if getattr(tokenizer, "has_chat_template", False):
        try:
            return list(tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                      add_generation_prompt=True, tokenize=True))
        except Exception as e:  # jinja raises TemplateError and plain exceptions alike
            raise BadInput(f"the model's chat template refused these messages: {e}") from None
    text = "".join(f"{_ROLES.get(m['role'], '')}{m['content']}\n" for m in messages) + _ROLES["assistant"]
    return list(tokenizer.encode(text.rstrip()))


def documents_question(request: GenerationRequest) -> tuple[str | None, str]:
    """(system prompt, question) of a request with documents: the prompt string, or the last
    user message after at most one system message."""
    if request.messages is None:
        if not isinstance(request.prompt, str):
            raise BadInput("with 'documents', 'prompt' must be the question as a string")
        return None, request.prompt
    roles = [m["role"] for m in request.messages]
    if roles not in (["user"], ["system", "user"], ["developer", "user"]):
        raise BadInput("with 'documents', send at most one system message and one user message (the question): "
                       "the documents are placed before it")
    return (request.messages[0]["content"] if len(roles) == 2 else None), request.messages[-1]["content"]


def context_length(model: Any) -> int | None:
    """The context length the model's config states, if any."""
    args = getattr(model, "args", None)
    for name in _CONTEXT_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# --- the worker ----------------------------------------------------------------------------

class ModelWorker:
    """The one thread that owns the model, and the bounded queue in front of it."""

    def __init__(self, engine: Engine, model: str, *, scheme: str, adapter_path: str | None = None,
                 max_queue: int = 32, max_running: int = 8, max_tokens_limit: int | None = None,
                 policy: SavePolicy = SavePolicy(), metrics: Metrics | None = None):
        self.engine = engine
        self.model_ref = model
        self.adapter_path = adapter_path
        self.scheme = scheme
        self.policy = policy
        self.metrics = metrics or Metrics()
        self.capacity = max_queue
        self.max_running = max_running
        # None: the model's context length, known once it is loaded.
        self.max_tokens_limit = max_tokens_limit
        self.loaded: LoadedModel | None = None
        self.batching = False  # whether this model's generations share decode steps (known once loaded)
        self._step_seconds = 0.0  # the last decode step's
        self._batch = DecodeBatch()  # the running rows' shared decode state (model thread only)
        # Prefill chunk sizes, learned from every job's chunks; on a GPU a new shape's first run costs a build.
        self._sizer = ChunkSizer(engine.prefill_chunk, new_shapes_slow=mx.default_device().type == mx.DeviceType.gpu)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        # What waits for a place among the running: new jobs, and parked ones (started, their
        # state kept), in the order they began to wait; at most `max_queue` of them.
        self._waiting: deque[Job | Running] = deque()
        self._arrived = threading.Condition()  # guards _waiting; notified when a job is queued
        self._stopping = threading.Event()
        self._running: deque[Running] = deque()  # only the worker's thread changes it
        self._job_seconds = 1.0  # moving average, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="tqstore-model", daemon=True)
        self.writer = BackgroundWriter()

    # -- the HTTP layer's side ----------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; it loads the model first (`ready` or `load_error` tells)."""
        self._thread.start()

    def generate(self, request: GenerationRequest, sink: Sink) -> Job:
        """Queue a generation whose events go to `sink`; QueueFull when the queue is full."""
        return self._submit(Job("generate", lambda job: self._generate(job, request), sink))

    def save(self, name: str, source: CacheSource, sink: Sink) -> Job:
        """Queue a PUT /v1/caches/{name} whose events go to `sink`; QueueFull when the queue is full."""
        return self._submit(Job("save", lambda job: self._save(job, name, source), sink))

    def count(self, request: GenerationRequest, sink: Sink) -> Job:
        """Queue a token count of a request's prompt (its Finished event carries the count)."""
        return self._submit(Job("count", lambda job: self._count(job, request), sink))

    def queue_state(self) -> QueueState:
        return QueueState(len(self._waiting), self.capacity, len(self._running), self.batching)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running jobs, fail the queued ones, wait for the thread to end, then give
        the background writer up to `timeout` seconds for the saves it still holds."""
        self._stopping.set()
        for running in list(self._running):
            running.job.cancel()
        self._drain()
        if self._thread.is_alive():
            self._thread.join(timeout)
        left = self.writer.pending()
        if not self.writer.close(timeout):
            log.warning("stopped with %d prompt saves unwritten after %.0f s: those prefixes are not stored", left,
                        timeout)

    def _submit(self, job: Job) -> Job:
        if self._stopping.is_set():
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        with self._arrived:
            if len(self._waiting) >= self.capacity:
                wait = self._job_seconds * (len(self._waiting) + 1)
                raise QueueFull(max(1, min(60, math.ceil(wait))))
            self._waiting.append(job)
            self._arrived.notify()
        return job

    def _drain(self) -> None:
        with self._arrived:
            waiting, self._waiting = list(self._waiting), deque()
        for item in waiting:
            job = item.job if isinstance(item, Running) else item
            job.send(Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")))

    # -- the owner thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            # This thread's MLX streams (mlx-lm generates on a thread-local one) own C++ threads:
            # end them here, or the process can abort at exit while they are torn down.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self.loaded = self.engine.model(self.model_ref, self.adapter_path)
            self.engine.codec_identity(self.loaded, self.scheme)  # built once, before the first request
        except BaseException as e:  # reported by run(), which then shuts down
            self.load_error = e
            self._stopping.set()
            self._drain()
            return
        if self.max_tokens_limit is None:
            self.max_tokens_limit = context_length(self.loaded.model) or UNKNOWN_CONTEXT_TOKENS
        self.batching = batchable(self.loaded, make_prompt_cache(self.loaded.model, self.scheme))
        if not self.batching:
            log.info("this model's caches cannot share decode steps: requests decode one at a time, in turns")
        self.ready.set()
        while not self._stopping.is_set():
            self._admit(wait=not self._running)
            if self._running:
                self._cycle()
        for running in self._running:  # stopped mid-generation: the server is going away
            running.job.send(Failed(ApiError(503, "the server is shutting down", type="server_error",
                                             code="shutting_down")))
        self._running.clear()
        self._drain()

    def _admit(self, wait: bool) -> None:
        """Start or resume waiting jobs, longest waiting first, while fewer than `max_running`
        run; waits a moment for one when `wait` (nothing runs)."""
        while len(self._running) < self.max_running:
            with self._arrived:
                if not self._waiting and wait:
                    self._arrived.wait(0.2)
                if not self._waiting:
                    return
                item = self._waiting.popleft()
            wait = False
            if isinstance(item, Running):  # parked: resumed where it stopped (a cancelled one ends at its next token)
                self._running.append(item)
            elif item.cancelled.is_set():
                self.metrics.count_cancelled()
            else:
                self._running.append(Running(item, item.work(item)))

    def _cycle(self) -> None:
        """Steps of the running jobs that do not wait on a Row, least model time first, then one
        batched decode step over every job that waits on one; then park jobs that have held
        their place for HOLD_SECONDS while others wait for one.

        The steps fit in CHUNK_SECONDS: the first job runs steps until the time is spent or it
        waits on a Row (a new request's prefill and its first Row in one cycle), each next job
        one or more steps if its last step fits in what is left. Once a job reaches its Row in a
        cycle, the started jobs after it wait: the new row decodes before a long prompt's next
        chunk (jobs not started yet still start, so requests that arrive together join together)."""
        others = sorted((r for r in self._running if r.pending is None), key=lambda r: r.seconds)
        left, ready = CHUNK_SECONDS, False
        for i, other in enumerate(others):
            if i and ((ready and other.seconds) or other.job.step_seconds > left):
                continue
            while left > 0 and other.pending is None and other in self._running:
                left -= self._own_step(other)
            ready = ready or other.pending is not None
        decoding = [r for r in self._running if r.pending is not None]
        if decoding:
            try:
                spent = self._batch.step(self.loaded.model, [r.pending for r in decoding])
            except BaseException as e:  # the worker must outlive any one step
                log.exception("a decode step failed")
                for running in decoding:
                    running.job.send(Failed(api_error(e)))
                    self._end(running)
                return
            self._step_seconds = spent
            self.metrics.decoded(len(decoding), spent)
            for running in decoding:
                running.seconds += spent
                running.held += spent
                self._advance(running)
        if self._waiting and not self._stopping.is_set():
            overdue = [r for r in self._running if r.held >= HOLD_SECONDS][:len(self._waiting)]
            for running in overdue:
                self._running.remove(running)
                self._park(running)

    def _own_step(self, running: Running) -> float:
        """Run one step of a job that does not wait on a Row (a prefill chunk, say); its model time."""
        t0 = time.perf_counter()
        self._advance(running)
        spent = time.perf_counter() - t0
        running.job.step_seconds = spent
        running.seconds += spent
        running.held += spent
        return spent

    def _advance(self, running: Running) -> None:
        """Run a job to its next yield; a job that ends or fails leaves the running ones."""
        try:
            running.pending = next(running.steps)
            return
        except StopIteration:
            pass
        except BaseException as e:  # the worker must outlive any one job
            if not isinstance(e, (ApiError, TqstoreError)):
                log.exception("%s job failed", running.job.kind)
            running.job.send(Failed(api_error(e)))
        self._end(running)

    def _end(self, running: Running) -> None:
        if running in self._running:
            self._running.remove(running)
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * running.seconds

    def _park(self, running: Running) -> None:
        """Put a running job at the back of the waiting line, its state kept. It takes the
        place of the one admitted next, so the line never grows past `max_queue`."""
        running.held = 0.0
        with self._arrived:
            self._waiting.append(running)

    def _tokens(self, prompt: str | Sequence[int] | None, messages: Sequence[dict] | None,
                tools: Sequence[Any] | None = None) -> list[int]:
        tokenizer = self.loaded.tokenizer
        if messages is not None:
            tokens = chat_tokens(tokenizer, messages, tools)
        else:
            tokens = completion_tokens(tokenizer, prompt)
        limit = getattr(getattr(self.loaded.model, "args", None), "vocab_size", None)
        if limit is not None and any(t >= limit for t in tokens):
            raise BadInput(f"token ids must be below the vocabulary size {limit}")
        if not tokens:
            raise BadInput("the prompt is empty: send at least one token")
        return tokens

    def _generation(self, job: Job, prompt: list[int], **options) -> Iterator[Row | None]:
        """The engine's generation of `prompt`: decoding in shared steps when the model batches."""
        if self.batching:
            return batched_generation(self.engine, self.loaded, self.scheme, prompt,
                                      step_seconds=lambda: self._step_seconds, chunk=self._chunks(job), **options)
        return self.engine.generation(self.loaded, self.scheme, prompt, **options)

    def _chunks(self, job: Job) -> Callable[[int], int]:
        """A prefill's chunk sizes (chunking.py): each chunk's model time, the job's step that ran
        it, goes to the worker's sizer before the next chunk is sized."""
        start: int | None = None

        def size(position: int) -> int:
            nonlocal start
            if start is not None:
                self._sizer.ran(position - start, job.step_seconds, position)
            start = position
            return self._sizer.size(position)

        return size

    def _generate(self, job: Job, request: GenerationRequest) -> Iterator[Row | None]:
        if request.documents:
            yield from self._generate_documents(job, request)
            return
        prompt = self._tokens(request.prompt, request.messages, request.tools)
        s = request.sampling
        # The server's cap: a finish_reason "length" tells the client it was reached.
        max_tokens = min(s.max_tokens, self.max_tokens_limit)
        scanner = StopScanner(s.stop)

        stop = _stop_callback(job, scanner)
        self.writer.wait_for(prompt)  # a prefix of this prompt still being stored: let it land first
        starts: list[Started] = []

        def accepted(started: Started) -> None:
            starts.append(started)
            job.send(Accepted(len(prompt), started.matched, started.tier))

        result, caches = yield from self._generation(
            job, prompt, max_tokens=max_tokens, temp=s.temperature, top_p=s.top_p, seed=s.seed, stop=stop,
            on_start=accepted)
        if job.cancelled.is_set():
            self.metrics.count_cancelled()
        else:
            rest = scanner.flush(result.text)
            if rest:
                job.send(Text(rest))
            gen = Generation(scanner.final(result.text), "stop" if scanner.end is not None else
                             (result.finish_reason or "length"), result.prompt_tokens, len(result.tokens),
                             result.cached_tokens, result.tier, result.restore_seconds, result.prefill_seconds,
                             result.generation_seconds, stop_sequence=scanner.matched)
            self.metrics.generated(gen, request.api)
            job.send(Finished(gen))
        # The prefill's checkpoints (window rows, block-end states) keep the saved prompt reusable by prefix.
        self._autosave(prompt, result, caches, starts[0].checkpoints if starts else None)

    def _generate_documents(self, job: Job, request: GenerationRequest) -> Iterator[Row | None]:
        """A request with the `documents` extension: its documents composed from stored chunks
        (texts not stored yet are stored), then the question (the prompt, or the last user
        message after an optional system message)."""
        system, question = documents_question(request)
        docs = [Document(**{kind: value}) for kind, value in request.documents]
        recompute = DEFAULT_RECOMPUTE if request.recompute is None else request.recompute
        question_tokens = self.loaded.prompt.after_documents_tokens(self.loaded.tokenizer, question)
        context = self.engine.chunks.composed_caches(self.loaded, docs, self.scheme, system=system,
                                                     recompute=recompute, question=question_tokens)
        prompt = context.tokens + question_tokens
        s = request.sampling
        scanner = StopScanner(s.stop)

        stop = _stop_callback(job, scanner)
        started = Started(context.caches, len(context.tokens), "composed", context.seconds)
        job.send(Accepted(len(prompt), context.reused, "composed"))
        result, _ = yield from self._generation(
            job, prompt, max_tokens=min(s.max_tokens, self.max_tokens_limit), temp=s.temperature, top_p=s.top_p,
            seed=s.seed, stop=stop, started=started)
        if job.cancelled.is_set():
            self.metrics.count_cancelled()
            return
        rest = scanner.flush(result.text)
        if rest:
            job.send(Text(rest))
        gen = Generation(scanner.final(result.text), "stop" if scanner.end is not None else
                         (result.finish_reason or "length"), len(prompt), len(result.tokens), context.reused,
                         "composed", context.seconds, result.prefill_seconds, result.generation_seconds,
                         context.reused, context.recomputed, scanner.matched)
        self.metrics.generated(gen, request.api)
        job.send(Finished(gen))

    def _autosave(self, prompt: list[int], result, caches: list[Any],
                  checkpoints: StateCheckpoints | None = None) -> None:
        """Store prompt[:-1] (a later identical prompt restores all but its last token) when the
        policy says so; errors are logged, never sent: the response is already complete."""
        stored = prompt[:-1]
        if not self.policy.enabled:
            return
        if len(prompt) < max(self.policy.min_tokens, 2):
            self.metrics.saved("short")
            return
        if result.cached_tokens >= len(stored):
            self.metrics.saved("covered")
            return
        name = self.policy.name_for(self.loaded.identity.digest, self.scheme, stored)
        computed = len(prompt) - result.cached_tokens
        # Prefill cost is close to linear at these lengths: scale the measured part to the whole.
        recorded = result.prefill_seconds * len(stored) / computed if computed else 0.0
        try:
            future = self.engine.store_caches(name, self.loaded, self.scheme, caches, stored,
                                              prefill_seconds=recorded, ttl=self.policy.ttl,
                                              metadata={"tqstore.saved_by": "serve"}, checkpoints=checkpoints,
                                              writer=self.writer)
        except BadInput as e:  # caches that cannot drop the answer (a full sliding window)
            log.info("not saving the prompt as %s: %s", name, e)
            self.metrics.saved("unsupported")
            return
        except Exception:
            log.exception("saving the prompt as %s failed", name)
            self.metrics.saved("failed")
            return
        # Timed from the hand-over: compressing ran above, on this thread, before the next job.
        t0 = time.perf_counter()

        def done(f: Future) -> None:
            if f.exception() is None:
                self.metrics.saved("saved", time.perf_counter() - t0)
            else:
                log.error("saving the prompt as %s failed", name, exc_info=f.exception())
                self.metrics.saved("failed")

        future.add_done_callback(done)

    def _count(self, job: Job, request: GenerationRequest) -> Iterator[None]:
        job.send(Finished(len(self._tokens(request.prompt, request.messages, request.tools))))
        yield from ()

    def _save(self, job: Job, name: str, source: CacheSource) -> Iterator[None]:
        if source.document is not None:
            if not source.document.strip():
                raise BadInput("the document is empty: nothing to save")
            tokens = self.loaded.prompt.context_tokens(self.loaded.tokenizer, source.document, source.system)
        else:
            # All but the last token, like the save policy: the same prompt later restores all
            # of it but the one token that must run to give logits.
            tokens = self._tokens(source.prompt, source.messages)[:-1]
            if not tokens:
                raise BadInput("the prompt is a single token: there is nothing to store before it")
        self.writer.wait_for(tokens)
        yield from self.engine.saving(name, self.loaded, tokens, scheme=self.scheme, pin=source.pinned,
                                      ttl=source.ttl, metadata={"tqstore.saved_by": "serve"})
        job.send(Finished(self.engine.store.info(name)))


def _stop_callback(job: Job, scanner: StopScanner) -> Callable[[str], bool]:
    """The engine's `stop`: forwards the text that is safe to send (it cannot end in a stop
    string) and says whether a stop string appeared or the client went away."""

    def stop(text: str) -> bool:
        new = scanner.feed(text)
        if new:
            job.send(Text(new))
        return scanner.end is not None or job.cancelled.is_set()

    return stop
