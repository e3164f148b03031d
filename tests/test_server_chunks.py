"""How the server cuts a long prompt's prefill into chunks and schedules them beside short
requests (tqstore/serve/chunking.py, worker.py `_chunks` and `_cycle`).

The chunk tests drive the worker's real sizer through `chunk_ends` (as Engine.prefill_steps
does) with each chunk's time from a cost model, the H200's as measured: a chunk whose (query
length, key length) is new pays a graph build (MLX's CUDA attention builds a cuDNN graph per
shape), a known one runs in a fixed cost plus a cost per token. Sized by the last chunk's time,
the chunks of a 16k-token prompt fell to 16 tokens, each a new shape: 62-68 s through the
server on the H200 against 0.2 s through the Engine."""

from __future__ import annotations

import threading
import time

import pytest

from model_folder import write_model_folder
from tqstore.engine.engine import Engine
from tqstore.serve.chunking import ChunkSizer
from tqstore.serve.openai_schema import GenerationRequest, Sampling
from tqstore.serve.autosave import SavePolicy
from tqstore.serve.jobs import Accepted, Failed, Finished, Job
from tqstore.serve.worker import ModelWorker
from turboquant.adapter.checkpoints import chunk_ends


def _prefill(worker: ModelWorker, tokens: int, seconds, seen: set) -> list[tuple[int, int]]:
    """Chunks (length, end) of a `tokens`-long prefill from position 0, each timed by
    `seconds(length, end, new shape)` and handed to the worker's sizer as the job's step."""
    job = Job("generate", lambda job: iter(()), lambda event: None)
    size, pos, chunks = worker._chunks(job), 0, []
    while pos < tokens:
        end = next(chunk_ends(pos, tokens, size(pos), None))
        job.step_seconds = seconds(end - pos, end, (end - pos, end) not in seen)
        seen.add((end - pos, end))
        chunks.append((end - pos, end))
        pos = end
    return chunks


SHORT = GenerationRequest(chat=False, model=None, stream=True, include_usage=False, prompt="Who pays?",
                          sampling=Sampling(max_tokens=1, temperature=0.0, top_p=1.0, seed=None, stop=()))


def _long_job(log: list[str], stop: threading.Event, seconds: float) -> Job:
    """A job of endless steps of `seconds` each (a long prompt's chunks), logged as "long"."""

    def steps(job):
        while not stop.is_set():
            time.sleep(seconds)
            log.append("long")
            yield None

    return Job("save", steps, lambda event: None)


def _short_sink(log: list[str], done: threading.Event):
    """The short request's sink: logs "accepted" and "finished" (or why it failed); sets `done` at the end."""

    def sink(event):
        if isinstance(event, Accepted):
            log.append("accepted")
        elif isinstance(event, (Finished, Failed)):
            log.append("finished" if isinstance(event, Finished) else f"failed {event.error}")
            done.set()

    return sink


def _worker(tmp_path) -> ModelWorker:
    return ModelWorker(Engine.open(tmp_path / "home"), "unused", scheme="raw")


def test_a_long_prompt_keeps_large_chunks_when_new_shapes_are_slow(tmp_path):
    """A graph build of 60 ms per new shape (every chunk of a first long prompt) must not shrink
    the chunks: on a GPU's sizer 16,384 tokens go in 32 chunks of 512, not a thousand of 16; a
    second prompt of the same length runs only shapes the first one built, and runs them warm
    (5 ms) within CHUNK_SECONDS, so its chunks stay at 512."""
    worker = _worker(tmp_path)
    worker._sizer = ChunkSizer(worker.engine.prefill_chunk, new_shapes_slow=True)  # the GPU's
    seen: set = set()

    def h200(length, end, new):
        return (0.06 if new else 0.0) + 0.001 + 8e-6 * length

    first = _prefill(worker, 16384, h200, seen)
    assert first == [(512, end) for end in range(512, 16385, 512)]
    second = _prefill(worker, 16384, h200, seen)
    assert second == first
    assert worker._sizer.pick() == 512


def test_a_gpu_sizer_steps_down_when_its_warm_chunks_are_too_slow():
    """Where a warm 512-token chunk takes 40 ms (a larger model), the GPU's sizer tries 256 (20 ms
    at 512's rate per token; 20.2 ms once its shapes run warm: too slow), then 128."""
    sizer = ChunkSizer(512, new_shapes_slow=True)
    seen: set = set()
    for _ in range(4):  # four prompts of 4,096 tokens; each chunk 0.5 ms + 0.077 ms a token warm
        pos = 0
        while pos < 4096:
            end = next(chunk_ends(pos, 4096, sizer.size(pos), None))
            sizer.ran(end - pos, (0.06 if (end - pos, end) not in seen else 0.0) + 0.0005 + 7.7e-5 * (end - pos), end)
            seen.add((end - pos, end))
            pos = end
    assert sizer.pick() == 128


def test_chunks_fit_the_time_when_it_grows_with_their_length(tmp_path):
    """Where a chunk's time is its tokens' (a CPU: 2 ms + 0.5 ms a token), chunks stay within
    CHUNK_SECONDS (32 tokens, 18 ms) and each ends at a multiple of its length, so the shapes of
    the next prompt repeat."""
    worker = _worker(tmp_path)
    chunks = _prefill(worker, 2048, lambda length, end, new: 0.002 + 0.0005 * length, set())
    assert {n for n, _ in chunks} <= {16, 32}
    assert all(end % n == 0 for n, end in chunks)
    assert sum(1 for n, _ in chunks if n == 32) >= len(chunks) - 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("chunks") / "tiny-llama", kind="llama")


def test_a_short_request_gets_its_first_token_before_a_long_jobs_next_step(tmp_path, llama):
    """A short request that arrives while a long job runs step after step (a long prompt's
    prefill chunks) runs its prefill and its first token with no step of the long job between
    them: its first token waits for at most the one step in progress when it arrived."""
    worker = ModelWorker(Engine.open(tmp_path / "home"), str(llama), scheme="raw", policy=SavePolicy(enabled=False))
    log: list[str] = []
    stop, done = threading.Event(), threading.Event()
    sink = _short_sink(log, done)
    worker.start()
    try:
        assert worker.ready.wait(60)
        worker.generate(SHORT, sink)  # on the idle worker first, as a warm-up (its first use of the model)
        assert done.wait(60)
        done.clear()
        log.clear()
        worker._submit(_long_job(log, stop, 0.02))  # 20 ms chunks
        while log.count("long") < 100:  # 2 s: more model time than the short one needs, even on a loaded box
            time.sleep(0.005)
        worker.generate(SHORT, sink)
        assert done.wait(60)
    finally:
        stop.set()
        worker.stop()
    short = log[log.index("accepted"):log.index("finished") + 1]
    assert short == ["accepted", "finished"], short


def test_a_request_that_arrives_mid_cycle_waits_for_one_short_step_not_the_cycle(tmp_path, llama):
    """A long job whose steps are short (5 ms: warm chunks, or a compression's steps) runs
    several of them per cycle; a request that arrives meanwhile starts after the step in
    progress, not after the rest of the cycle's 20 ms of them (up to four, before)."""
    worker = ModelWorker(Engine.open(tmp_path / "home"), str(llama), scheme="raw", policy=SavePolicy(enabled=False))
    log: list[str] = []
    stop, done = threading.Event(), threading.Event()
    sink = _short_sink(log, done)
    worker.start()
    waits = []
    try:
        assert worker.ready.wait(60)
        worker.generate(SHORT, sink)  # a warm-up: the model's first use
        assert done.wait(60)
        worker._submit(_long_job(log, stop, 0.005))
        for trial in range(6):
            done.clear()
            seen = log.count("long")
            while log.count("long") < seen + 7 + trial:  # submitted at varying points of a cycle
                time.sleep(0.001)
            log.append("submitted")
            worker.generate(SHORT, sink)
            assert done.wait(60)
            since = log[len(log) - 1 - log[::-1].index("submitted"):]
            waits.append(since[:since.index("accepted")].count("long"))
    finally:
        stop.set()
        worker.stop()
    assert max(waits) <= 1, waits


def test_a_request_whose_client_leaves_mid_prefill_stores_what_its_chunks_computed(tmp_path):
    """An agent that times out mid-prefill and asks again pays only the rest (the autosave
    refused caches holding fewer tokens than the prompt, and counted it "unsupported")."""
    model = write_model_folder(tmp_path / "tiny-llama", kind="llama", num_hidden_layers=2, hidden_size=128,
                               num_attention_heads=4, head_dim=64, intermediate_size=256)
    engine = Engine.open(tmp_path / "home")
    prompt = " ".join(f"w{i % 97}" for i in range(700))
    request = GenerationRequest(chat=False, model=None, stream=True, include_usage=False, prompt=prompt,
                                sampling=Sampling(max_tokens=2, temperature=0.0, top_p=1.0, seed=None, stop=()))
    worker = ModelWorker(engine, str(model), scheme="raw", policy=SavePolicy(min_tokens=32))
    events = []
    job = worker.generate(request, events.append)

    def size(position: int) -> int:  # chunks of 64 tokens; the client leaves once 256 are prefilled
        if position >= 256:
            job.cancel()
        return 64

    worker._sizer.size, worker._sizer.pick = size, lambda: 16
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while not engine.store.ls() and time.monotonic() < deadline:  # the autosave after the cancel
            time.sleep(0.05)
    finally:
        worker.stop()
    assert job.cancelled.is_set() and not any(isinstance(e, (Finished, Failed)) for e in events)
    (entry,) = engine.store.ls()
    assert 256 <= entry.tokens < 700
    again = Engine.open(tmp_path / "home")
    loaded = again.model(str(model))
    tokens = loaded.tokenizer.encode(prompt)
    assert again.generate(loaded, "raw", tokens, max_tokens=1).cached_tokens == entry.tokens
