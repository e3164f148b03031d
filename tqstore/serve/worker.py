"""The model side of `tqstore serve`: the one thread that owns the model, and the model work of
each job (a generation, documents composed then answered, a save, a token count).

The bounded queue and the turns of the running jobs are scheduling.py's, the jobs and their
events jobs.py's, tokenizing prompts.py's and the save policy autosave.py's; how they work
together:

MLX work (loading, tokenizing, prefill, decode, compress, store) happens only on the worker's
thread; the HTTP layer submits jobs and gets each job's events (Accepted, Text, Finished,
Failed) through the job's `sink`, called on the worker's thread. Up to `max_running` jobs run at
once. A job is a generator: it yields None after a step of its own (a prefill chunk, a token of
a family that cannot batch), a `PrefillRow` when its prompt's short prefill waits for a shared
pass (tqstore/engine/shared_prefill.py), and a `Row` when it waits for its next token from a
shared decode step (tqstore/engine/batch.py). Each cycle of the worker runs steps of the jobs
waiting on neither, least model time first, while they fit in CHUNK_SECONDS, then one forward
pass over the waiting short prefills, then one batched decode step over every job waiting on a
Row (joining and leaving between steps), so a long prompt's prefill chunks (sized by
chunking.py) interleave with the running decode, and a new request's prefill and first token
go before a long one's next chunk. A running job that has had HOLD_SECONDS of model time while others wait is parked: it keeps its state and goes to the
back of the line, and the job that waited longest takes its place, so no request waits for the
running ones to end. A client that goes away cancels its job: a queued job is skipped, a
running one stops at its next token (the engine's `stop` callback). After a response is
complete the worker compresses the new prefix (the save policy) at the end of the job's last
step and hands it to a background writer (background.py), which serializes and
stores it while the worker takes the next request; a request whose prompt extends a prefix
still being written waits for that write only, so it finds the prefix stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Callable

import mlx.core as mx

from turboquant import make_prompt_cache

from tqstore.engine.background import BackgroundWriter
from tqstore.engine.batch import Row, batchable, batched_generation
from tqstore.engine.chunks import Document
from tqstore.engine.defaults import DEFAULT_RECOMPUTE
from tqstore.engine.engine import Engine
from tqstore.engine.prefill import PrefillRow, Started
from tqstore.errors import BadInput
from tqstore.models.loading import LoadedModel
from tqstore.serve.autosave import SavePolicy, autosave
from tqstore.serve.chunking import ChunkSizer
from tqstore.serve.jobs import Accepted, Finished, Job, Sink, Text, shutting_down
from tqstore.serve.metrics import Metrics, QueueState
from tqstore.serve.openai_schema import CacheSource, Generation, GenerationRequest, StopScanner
from tqstore.serve.prompts import UNKNOWN_CONTEXT_TOKENS, context_length, documents_question, request_tokens
from tqstore.serve.scheduling import Scheduler

log = logging.getLogger("tqstore.serve")


class ModelWorker:
    """The one thread that owns the model, and the bounded queue in front of it (scheduling.py);
    its jobs' model work is here, tokenizing in prompts.py, the save policy in autosave.py."""

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
        # None: the model's context length, known once it is loaded.
        self.max_tokens_limit = max_tokens_limit
        self.loaded: LoadedModel | None = None
        self.batching = False  # whether this model's generations share decode steps (known once loaded)
        self._scheduler = Scheduler(max_queue, max_running, self.metrics)
        # Prefill chunk sizes, learned from every job's chunks; on a GPU a new shape's first run costs a build.
        self._sizer = ChunkSizer(engine.prefill_chunk, new_shapes_slow=mx.default_device().type == mx.DeviceType.gpu)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
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
        """How many jobs wait and run."""
        return self._scheduler.state(self.batching)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running jobs, fail the queued ones, wait for the thread to end, then give
        the background writer up to `timeout` seconds for the saves it still holds."""
        self._scheduler.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        left = self.writer.pending()
        if not self.writer.close(timeout):
            log.warning("stopped with %d prompt saves unwritten after %.0f s: those prefixes are not stored", left,
                        timeout)

    def _submit(self, job: Job) -> Job:
        return self._scheduler.submit(job)

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
            self._scheduler.stopping.set()
            self._scheduler.drain()
            return
        if self.max_tokens_limit is None:
            self.max_tokens_limit = context_length(self.loaded.model) or UNKNOWN_CONTEXT_TOKENS
        self.batching = batchable(self.loaded, make_prompt_cache(self.loaded.model, self.scheme,
                                                                   verdicts=self.engine.models.verdicts(self.loaded)))
        if not self.batching:
            log.info("this model's caches cannot share decode steps: requests decode one at a time, in turns")
        self.ready.set()
        self._scheduler.run(self.loaded.model)

    # -- the jobs' model work -----------------------------------------------------------------

    def _generation(self, job: Job, prompt: list[int], **options) -> Iterator[Row | PrefillRow | None]:
        """The engine's generation of `prompt`: decoding in shared steps when the model batches."""
        if self.batching:
            # A prefill that fits one chunk of the current size runs in the cycle's shared pass.
            return batched_generation(self.engine, self.loaded, self.scheme, prompt,
                                      step_seconds=lambda: self._scheduler.step_seconds, chunk=self._chunks(job),
                                      share=self._sizer.pick(), **options)
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

    def _generate(self, job: Job, request: GenerationRequest) -> Iterator[Row | PrefillRow | None]:
        if request.documents:
            yield from self._generate_documents(job, request)
            return
        prompt = request_tokens(self.loaded, request.prompt, request.messages, request.tools)
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
            self._ended_cancelled(job)
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
        autosave(self.engine, self.policy, self.metrics, self.writer, self.loaded, self.scheme, prompt, result, caches,
                 starts[0].checkpoints if starts else None, starts[0].recorded if starts else 0.0)

    def _generate_documents(self, job: Job, request: GenerationRequest) -> Iterator[Row | PrefillRow | None]:
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
        # Restored from the store (the documents this request prefilled and stored are not).
        cached = context.reused
        job.send(Accepted(len(prompt), cached, "composed"))
        result, _ = yield from self._generation(
            job, prompt, max_tokens=min(s.max_tokens, self.max_tokens_limit), temp=s.temperature, top_p=s.top_p,
            seed=s.seed, stop=stop, started=started)
        if job.cancelled.is_set():
            self._ended_cancelled(job)
            return
        rest = scanner.flush(result.text)
        if rest:
            job.send(Text(rest))
        gen = Generation(scanner.final(result.text), "stop" if scanner.end is not None else
                         (result.finish_reason or "length"), len(prompt), len(result.tokens), cached,
                         "composed", context.seconds, result.prefill_seconds, result.generation_seconds,
                         cached, context.recomputed, scanner.matched)
        self.metrics.generated(gen, request.api)
        job.send(Finished(gen))

    def _ended_cancelled(self, job: Job) -> None:
        """A generation stopped by `Job.cancel`: its client left (nothing to send), or the server
        is stopping, whose client still waits for an end (a stream cut without one, a whole
        response a plain 500 after uvicorn's grace)."""
        if self._scheduler.stopping.is_set():
            job.send(shutting_down())
        else:
            self.metrics.count_cancelled()

    def _count(self, job: Job, request: GenerationRequest) -> Iterator[None]:
        job.send(Finished(len(request_tokens(self.loaded, request.prompt, request.messages, request.tools))))
        yield from ()

    def _save(self, job: Job, name: str, source: CacheSource) -> Iterator[None]:
        if source.document is not None:
            if not source.document.strip():
                raise BadInput("the document is empty: nothing to save")
            tokens = self.loaded.prompt.context_tokens(self.loaded.tokenizer, source.document, source.system)
        else:
            # All but the last token, like the save policy: the same prompt later restores all
            # of it but the one token that must run to give logits.
            tokens = request_tokens(self.loaded, source.prompt, source.messages)[:-1]
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
