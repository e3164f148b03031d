"""Continuous batching in the model worker (issue 30): generations decode together in one
forward pass per step, and a greedy answer is the same alone and among seven others. The
worker runs in-process on a tiny random-weight llama (8 layers, 2 KV heads), without HTTP."""

from __future__ import annotations

import threading
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kernel_backend import force_backend
from kernel_support import emulate
from turboquant.attention import kernels
from turboquant.attention.kernels import ragged
from model_folder import write_model_folder
from server_process import parse_prometheus
from tqstore.engine.batch import DecodeBatch, batchable, batched_generation
from tqstore.engine.engine import Engine
from tqstore.engine.prefill import PrefillRow, finish
from tqstore.engine.shared_prefill import prefill_rows
from tqstore.serve.metrics import Metrics
from tqstore.serve.openai_schema import GenerationRequest, Sampling
from tqstore.serve.autosave import SavePolicy
from tqstore.serve.jobs import Accepted, Failed, Finished, Text
from tqstore.serve.worker import ModelWorker
from turboquant import TurboQuantKVCache, make_prompt_cache
from turboquant.cache.mirror import MIRROR_ENV, mirror_tokens

GREEDY = Sampling(max_tokens=12, temperature=0.0, top_p=1.0, seed=None, stop=())
PROMPTS = [f"Who pays for delays {i}? " + "The contract says the seller pays. " * i for i in range(8)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny llama at a sixteenth of its compute per token (2 layers, hidden 128, 4 heads of
    64, MLP 256): the tests marked exact_blas here run on the bundled reference BLAS, where the
    8-layer one made this module most of that pass's 2 min 18 s on 2 cores. Batching's
    bit-for-bit promises do not depend on the model's size."""
    return write_model_folder(tmp_path_factory.mktemp("batch") / "tiny-llama", kind="llama", num_hidden_layers=2,
                              hidden_size=128, num_attention_heads=4, head_dim=64, intermediate_size=256)


class Collect:
    """A job's sink: its events, and an Event set when it ends."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    def result(self):
        assert self.done.wait(120), self.events
        last = self.events[-1]
        assert isinstance(last, Finished), last
        return last.value, "".join(e.text for e in self.events if isinstance(e, Text))


def _serve(engine, llama, scheme, requests, max_running=8):
    """Run `requests` on a fresh worker, all queued before it loads the model (so they run
    together); their (Generation, streamed text) and the worker's metrics text."""
    metrics = Metrics()
    worker = ModelWorker(engine, str(llama), scheme=scheme, max_running=max_running,
                         policy=SavePolicy(enabled=False), metrics=metrics)
    sinks = [Collect() for _ in requests]
    for request, sink in zip(requests, sinks):
        worker.generate(request, sink)
    worker.start()
    try:
        results = [sink.result() for sink in sinks]
    finally:
        worker.stop()
    return results, parse_prometheus(metrics.render(engine.store.stats(), worker.queue_state()))


def _request(prompt: str, sampling: Sampling = GREEDY) -> GenerationRequest:
    return GenerationRequest(chat=False, model=None, sampling=sampling, stream=True, include_usage=False,
                             prompt=prompt)


def test_greedy_raw_answers_are_the_same_alone_and_in_a_batch_of_eight(tmp_path, llama):
    engine = Engine.open(tmp_path / "home")
    batched, samples = _serve(engine, llama, "raw", [_request(p) for p in PROMPTS])
    # Eight rows shared decode steps (the histogram's cumulative count of steps with more than 4).
    assert samples["tqstore_batching"] == 1
    assert samples['tqstore_batch_size_bucket{le="8.0"}'] > samples['tqstore_batch_size_bucket{le="4.0"}']
    loaded = engine.model(str(llama))
    for prompt, (gen, streamed) in zip(PROMPTS, batched):
        alone = engine.generate(loaded, "raw", loaded.tokenizer.encode(prompt), max_tokens=GREEDY.max_tokens)
        assert gen.text == streamed == alone.text and gen.completion_tokens == len(alone.tokens) == 12
    single, _ = _serve(engine, llama, "raw", [_request(PROMPTS[3])], max_running=1)
    assert single[0][0].text == batched[3][0].text


def test_short_requests_that_arrive_together_prefill_in_one_pass(tmp_path, llama):
    """Eight short prompts queued together start together: one shared prefill pass of all eight
    (the metric), then decode steps of eight rows, each answer the one it gets alone."""
    engine = Engine.open(tmp_path / "home")
    prompts = [f"Who pays {i}?" for i in range(8)]
    batched, samples = _serve(engine, llama, "raw", [_request(p) for p in prompts])
    assert samples["tqstore_prefill_batch_size_count"] == 1 and samples["tqstore_prefill_batch_size_sum"] == 8
    assert samples['tqstore_batch_size_bucket{le="4.0"}'] == 0  # no step ran fewer than all eight rows
    loaded = engine.model(str(llama))
    for prompt, (gen, streamed) in zip(prompts, batched):
        alone = engine.generate(loaded, "raw", loaded.tokenizer.encode(prompt), max_tokens=GREEDY.max_tokens)
        assert gen.text == streamed == alone.text


def test_a_failed_shared_prefill_fails_its_requests_and_the_worker_serves_on(tmp_path, llama, monkeypatch):
    """A shared prefill pass that raises fails every request in it (a 500 in the API's shape,
    nothing half-answered) and the model thread goes on: the next request is answered."""
    import tqstore.serve.scheduling as scheduling

    real, calls = scheduling.prefill_rows, []

    def broken_once(model, rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(model, rows)

    monkeypatch.setattr(scheduling, "prefill_rows", broken_once)
    engine = Engine.open(tmp_path / "home")
    worker = ModelWorker(engine, str(llama), scheme="raw", max_running=8, policy=SavePolicy(enabled=False),
                         metrics=Metrics())
    failed = [Collect() for _ in range(3)]
    for i, sink in enumerate(failed):
        worker.generate(_request(f"Who pays {i}?"), sink)
    worker.start()
    try:
        for sink in failed:
            assert sink.done.wait(120)
            assert [type(e) for e in sink.events] == [Accepted, Failed]  # accepted, then no text
            assert sink.events[-1].error.status == 500
        after = Collect()
        worker.generate(_request("Who pays 7?"), after)
        gen, _ = after.result()
    finally:
        worker.stop()
    assert calls == [3, 1] and gen.completion_tokens == GREEDY.max_tokens


@pytest.mark.exact_blas
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_of_any_length_decode_the_tokens_they_decode_alone(tmp_path, llama, family):
    """decode_step itself, on rows whose caches hold 3 to 60 tokens: the same tokens and the
    same first log-probabilities as Engine.generate (bit for bit), raw scheme, for each family
    in BATCHED_FAMILIES (mistral is llama's code)."""
    folder = llama if family == "llama" else write_model_folder(tmp_path / family, kind=family, num_hidden_layers=4,
                                                                intermediate_size=256)  # (as `llama`'s)
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(folder))
    assert batchable(loaded, make_prompt_cache(loaded.model, "raw"))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    gens = [batched_generation(engine, loaded, "raw", p, max_tokens=6) for p in prompts]
    pending, results = _first_rows(gens), [None] * len(gens)
    batch = DecodeBatch()
    while any(p is not None for p in pending):
        live = [i for i, p in enumerate(pending) if p is not None]
        served = {id(r) for r in batch.step(loaded.model, [pending[i] for i in live])}
        for i in (i for i in live if id(pending[i]) in served):
            try:
                pending[i] = gens[i].send(None)
            except StopIteration as done:
                results[i], pending[i] = done.value[0], None
    for prompt, result in zip(prompts, results):
        alone = engine.generate(loaded, "raw", prompt, max_tokens=6)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)


def test_sampled_seeded_answers_do_not_depend_on_the_batch(tmp_path, llama):
    engine = Engine.open(tmp_path / "home")
    sampled = replace(GREEDY, temperature=1.0, seed=11)
    together, _ = _serve(engine, llama, "raw", [_request(p, sampled) for p in PROMPTS[:4]])
    alone, _ = _serve(engine, llama, "raw", [_request(PROMPTS[2], sampled)], max_running=1)
    assert together[2][0].text == alone[0][0].text
    loaded = engine.model(str(llama))
    direct = engine.generate(loaded, "raw", loaded.tokenizer.encode(PROMPTS[2]), max_tokens=12, temp=1.0, seed=11)
    assert together[2][0].text == direct.text  # the same draws as the unbatched Engine path


def test_stop_strings_and_the_token_cap_end_rows_that_leave_the_batch(tmp_path, llama):
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    free = engine.generate(loaded, "raw", loaded.tokenizer.encode(PROMPTS[1]), max_tokens=12).text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert len(stop) == 3
    requests = [_request(PROMPTS[1], replace(GREEDY, stop=(stop,))),
                _request(PROMPTS[2], replace(GREEDY, max_tokens=2)),
                _request(PROMPTS[3], replace(GREEDY, max_tokens=30))]
    [(cut, cut_text), (capped, _), (long, _)], _ = _serve(engine, llama, "raw", requests)
    assert cut.finish_reason == "stop" and cut.text == cut_text == free[:free.index(stop)]
    assert capped.finish_reason == "length" and capped.completion_tokens == 2
    assert long.completion_tokens == 30


def test_families_with_windows_do_not_batch(tmp_path):
    folder = write_model_folder(tmp_path / "gemma", kind="gemma3_text")
    loaded = Engine.open(tmp_path / "home").model(str(folder))
    assert not batchable(loaded, make_prompt_cache(loaded.model, "raw"))


def _first_rows(gens):
    """Run batched generations through their prefills to their first Row each."""
    rows = []
    for g in gens:
        row = next(g)
        while row is None:
            row = next(g)
        rows.append(row)
    return rows


def _step_all(batch, loaded, gens, absent=lambda step, i: False, first=None):
    """Step generators to their end through `batch` (from their `first` rows, if taken); row i
    sits out the steps where `absent(step, i)`. Their (result, caches), and the largest group seen."""
    pending, results, largest, step = first or _first_rows(gens), [None] * len(gens), 0, 0
    while any(p is not None for p in pending):
        live = [i for i, p in enumerate(pending) if p is not None and not absent(step, i)]
        served = {id(r) for r in batch.step(loaded.model, [pending[i] for i in live])}
        largest = max(largest, len(batch.members))
        for i in (i for i in live if id(pending[i]) in served):
            try:
                pending[i] = gens[i].send(None)
            except StopIteration as done:
                results[i], pending[i] = done.value, None
        step += 1
    return results, largest


@pytest.mark.exact_blas
def test_rows_that_leave_the_group_and_come_back_decode_the_tokens_they_decode_alone(tmp_path, llama):
    """Rows parked for some steps (their new rows go back to their own caches and are copied in
    again when they return) and rows that grow past the group's length limit (they go on over
    their own caches) decode what they decode alone, bit for bit on the first token; a row
    that left the group ends with its own caches holding every row, bit for bit those of the
    same generation decoded on its own caches throughout."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:4]]
    limit = sorted(len(p) for p in prompts)[1] + 4  # two rows start in the group; the longer leaves it after 4 steps
    gens = [batched_generation(engine, loaded, "raw", p, max_tokens=10) for p in prompts]
    results, largest = _step_all(DecodeBatch(group_tokens=limit), loaded, gens,
                                 absent=lambda step, i: i == 1 and 2 <= step < 5 or i == 2 and step == 6)
    assert largest == 2  # the shared buffers did run rows together (the other two beside them, on their own caches)
    for prompt, (result, _) in zip(prompts, results):
        alone = engine.generate(loaded, "raw", prompt, max_tokens=10)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)
    [(_, own)], _ = _step_all(DecodeBatch(group_tokens=0), loaded,
                              [batched_generation(engine, loaded, "raw", prompts[1], max_tokens=10)])
    parked = results[1][1]
    for a, b in zip(own, parked):
        # the prompt but its last token, the 10 tokens run, and the step run ahead of the last
        assert a.offset == b.offset == len(prompts[1]) - 1 + 10 + 1
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            assert mx.array_equal(x, y)


@pytest.mark.exact_blas
def test_prefill_in_chunks_of_any_size_gives_the_same_caches(tmp_path, llama):
    """The server sizes prefill chunks by time (`chunk`): caches filled in chunks of 7, then
    growing, are bit for bit those of the engine's own chunks."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    tokens = loaded.tokenizer.encode(PROMPTS[7] * 3)
    assert len(tokens) > 100
    whole, chunked = make_prompt_cache(loaded.model, "raw"), make_prompt_cache(loaded.model, "raw")
    engine.prefill(loaded, whole, tokens)
    sizes = iter([7, 7, 30] + [60] * 10)
    steps = sum(1 for _ in engine.prefill_steps(loaded, chunked, tokens, chunk=lambda position: next(sizes)))
    assert steps == 3 + -(-(len(tokens) - 44) // 60)
    for a, b in zip(whole, chunked):
        assert a.offset == b.offset == len(tokens)
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            assert mx.array_equal(x, y)


def _stack_sizes(monkeypatch, kind) -> list[int]:
    """How many rows each `kind.attend` call (RowStack or DecodedStack) was given, as they come."""
    sizes = []
    attend = kind.attend
    monkeypatch.setattr(kind, "attend", lambda self, caches, *a: sizes.append(len(caches)) or attend(self, caches, *a))
    return sizes


@pytest.mark.exact_blas
@pytest.mark.parametrize("scheme", ["turbo4", "turbo5v4"])
def test_compressed_rows_attend_stacked_or_grouped_and_answer_as_the_engine_does(tmp_path, llama, monkeypatch,
                                                                               scheme):
    """Rows of a compressed scheme attend as `ask` does. Past a block (256 tokens) they are
    compressed and attend over their compressed storage (the group's dense attention over their
    decoded rows gave other answers than `ask` for the same prompt, which a reliability trial
    through the server caught): rows of one stored layout together in a RowStack, prompts past
    a block's end (their own block means) among them. Shorter ones decode raw until a block is
    held (`TurboQuantKVCache.defer`), as alone, and so join the raw rows' group. Each answers
    bit for bit as alone."""
    import tqstore.engine.batch as batch_module

    stacked = _stack_sizes(monkeypatch, batch_module.RowStack)
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    long = loaded.tokenizer.encode(" ".join(PROMPTS) * 2)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:4]] + [long[:n] for n in (258, 270, 300)]
    gens = [batched_generation(engine, loaded, scheme, p, max_tokens=6) for p in prompts]
    results, grouped = _step_all(DecodeBatch(), loaded, gens)
    assert grouped == 4 and stacked and max(stacked) == 3
    for prompt, (result, caches) in zip(prompts, results):
        alone = engine.generate(loaded, scheme, prompt, max_tokens=6)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)
        assert all(isinstance(c, TurboQuantKVCache) and c.compressed == (len(prompt) > 256) for c in caches)


def test_a_long_prompts_compression_runs_in_steps_and_answers_as_at_once(tmp_path, llama, monkeypatch):
    """The server's generation compresses a long prompt in steps (`COMPRESS_ROWS` rows over all
    layers per evaluation, one block per layer here), yielding between them as between prefill
    chunks so that other requests decode meanwhile; the caches hold every row at each step, and
    the answer and its stored bytes are bit for bit those of the prompt compressed at once (the
    form the tests above hold to Engine.generate)."""
    import tqstore.engine.batch as batch_module

    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    long = loaded.tokenizer.encode(" ".join(PROMPTS) * 3)[:520]
    answers = []
    for rows in (None, 256):  # at once (as before), then in steps
        monkeypatch.setattr(batch_module, "COMPRESS_ROWS", rows)
        starts, seen = [], []
        gen = batched_generation(engine, loaded, "turbo4", long, max_tokens=4, on_start=starts.append)
        row = next(gen)
        while row is None:
            seen.append(sorted({c.stored for c in starts[0].caches if isinstance(c, TurboQuantKVCache)}))
            row = next(gen)
        [answer], _ = _step_all(DecodeBatch(), loaded, [gen], first=[row])
        answers.append(answer)
    assert [s for s in seen if s != [0]][-3:] == [[256], [512], [519]]
    (at_once, caches_at_once), (in_steps, caches) = answers
    assert in_steps.tokens == at_once.tokens
    assert mx.array_equal(in_steps.first_logprobs, at_once.first_logprobs)
    for a, b in zip(caches, caches_at_once):
        ra, rb = a.to_record(), b.to_record()
        assert ra.arrays.keys() == rb.arrays.keys()
        assert all(mx.array_equal(ra.arrays[n], rb.arrays[n]).item() for n in ra.arrays)


# slow: the emulator runs a thread per lane for every layer's launch (10 s alone, 50 s beside the
# rest of the suite on 2 cores); tests/test_mirror.py runs the DecodedStack itself by default.
@pytest.mark.slow
@pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")
def test_on_cuda_short_compressed_rows_join_the_group_and_answer_as_the_engine_does(tmp_path, llama, monkeypatch):
    """On CUDA (routed here, the ragged kernel run by the emulator) compressed rows under 1,024
    tokens attend over their decoded mirrors, alone and in the server alike, and rows under a
    block (256 tokens) over their raw rows: all of them in the group, one kernel over each
    row's own length, answering what Engine.generate answers on its own (the same values,
    float32 sums in another order)."""
    force_backend(monkeypatch, "cuda", emulate.kernel)
    monkeypatch.setenv(MIRROR_ENV, "1024")
    monkeypatch.setattr(ragged, "MAX_WARPS", 1)  # the emulator runs an OS thread per lane: fewer lanes
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:2]]
    prompts.append(loaded.tokenizer.encode(" ".join(PROMPTS) * 2)[:260])
    gens = [batched_generation(engine, loaded, "turbo5v4", p, max_tokens=4) for p in prompts]
    results, grouped = _step_all(DecodeBatch(), loaded, gens)
    assert grouped == len(prompts)
    for prompt, (result, caches) in zip(prompts, results):
        alone = engine.generate(loaded, "turbo5v4", prompt, max_tokens=4)
        assert result.tokens == alone.tokens
        assert np.allclose(np.array(result.first_logprobs), np.array(alone.first_logprobs), atol=1e-4)
        long = len(prompt) > 256
        assert all(c.compressed == long and (c._mirror is not None) == long for c in caches)


def _on_cuda_without_kernels(monkeypatch) -> None:
    """Route the backend choice to CUDA (decoded mirrors on) with the ragged kernel declining
    every shape, so each attention is MLX's SDPA here: the group's masked call, a stack's rows
    one by one (`DecodedStack`'s fallback), each layer alone over its mirror."""
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    monkeypatch.setenv(MIRROR_ENV, "1024")
    monkeypatch.setattr(ragged, "variant", lambda *args: None)


@pytest.mark.exact_blas
def test_on_cuda_compressed_rows_on_their_mirrors_join_the_group(tmp_path, llama, monkeypatch):
    """On CUDA a TurboQuant row whose layers read their decoded mirrors joins the raw rows'
    group (its caches untouched while it stays, as a raw member's), as rows shorter than a block
    (raw until one is held) do everywhere: rows of unequal length, raw and compressed, answer
    bit for bit what Engine.generate answers alone. A row leaves before the step that
    compresses it (its first block held) and comes back after it, on its mirror; a row that
    leaves for good (past the group's limit) ends with the records, bit for bit, of the same
    generation decoded on its own caches throughout."""
    import tqstore.engine.batch as batch_module

    _on_cuda_without_kernels(monkeypatch)
    given_back = []
    real_give_back = batch_module.DecodeBatch._give_back

    def give_back(self, j, row):
        given_back.append((id(row), self.lengths[j]))
        real_give_back(self, j, row)

    monkeypatch.setattr(batch_module.DecodeBatch, "_give_back", give_back)
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    long = loaded.tokenizer.encode(" ".join(PROMPTS) * 2)[:250]
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:3]] + [long]
    schemes = ["turbo4", "raw", "turbo5v4", "turbo4"]
    gens = [batched_generation(engine, loaded, s, p, max_tokens=16) for s, p in zip(schemes, prompts)]
    rows = _first_rows(gens)
    long_row = id(rows[3])
    results, largest = _step_all(DecodeBatch(group_tokens=262), loaded, gens, first=rows)
    assert largest == 4
    # the long row: out for the step at 256 (it compresses rows [0, 256)), back at 257, out for good at 262
    assert [n for r, n in given_back if r == long_row] == [256, 262]
    for scheme, prompt, (result, caches) in zip(schemes, prompts, results):
        alone = engine.generate(loaded, scheme, prompt, max_tokens=16)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)
    [(_, own)], _ = _step_all(DecodeBatch(group_tokens=0), loaded,
                              [batched_generation(engine, loaded, "turbo4", long, max_tokens=16)])
    for a, b in zip(own, results[3][1]):
        assert a.offset == b.offset == len(long) - 1 + 16 + 1 and a.stored == b.stored == 256
        ra, rb = a.to_record(), b.to_record()
        assert ra.arrays.keys() == rb.arrays.keys()
        assert all(mx.array_equal(ra.arrays[n], rb.arrays[n]).item() for n in ra.arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["raw", "turbo4", "turbo5v4"])
def test_on_the_gpu_compressed_rows_join_the_group_and_answer_as_alone(tmp_path, llama, on_gpu, scheme):
    """On a GPU with decoded mirrors (CUDA), short compressed rows of unequal length decode in
    the group, one ragged kernel over each row's own length, and answer the tokens
    Engine.generate answers alone, as raw rows do; one row compresses at its first full block
    (out of the group for that step) and comes back on its mirror. First log-probabilities
    agree to 1e-2, raw's as compressed ones': MLX's CUDA float32 matmuls depend on the batch
    (8 rows against 1 moved them by about 1e-3 on an H100)."""
    if not mirror_tokens():
        pytest.skip("no decoded mirrors on this backend (CUDA only)")
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:5]]
    prompts.append(loaded.tokenizer.encode(" ".join(PROMPTS) * 2)[:250])
    gens = [batched_generation(engine, loaded, scheme, p, max_tokens=12) for p in prompts]
    results, grouped = _step_all(DecodeBatch(), loaded, gens)
    assert grouped == len(prompts)
    for prompt, (result, caches) in zip(prompts, results):
        alone = engine.generate(loaded, scheme, prompt, max_tokens=12)
        assert result.tokens == alone.tokens
        assert np.allclose(np.array(result.first_logprobs), np.array(alone.first_logprobs), atol=1e-2)
    assert scheme == "raw" or all(c.compressed and c.stored == 256 for c in results[-1][1])


@pytest.mark.exact_blas
@pytest.mark.parametrize("scheme", ["raw", "turbo4", "turbo5v4"])
def test_prompts_prefilled_in_one_pass_answer_as_alone(tmp_path, llama, scheme):
    """Short prompts of unequal length, fresh and after a restored stored prefix, run their
    prefills in one forward pass (`prefill_rows`, right-padded), then decode together: the same
    tokens and, bit for bit, the same first log-probabilities as each one alone, and caches
    holding exactly their own tokens (the padding reaches none), fresh compressed layers encoded
    as each row's own start of decoding encodes them."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    stored = loaded.tokenizer.encode(" ".join(PROMPTS))[:300]
    engine.save_tokens("prefix", loaded, stored, scheme=scheme)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:5]] + [stored + loaded.tokenizer.encode(PROMPTS[2])]
    assert len({len(p) for p in prompts}) == len(prompts)
    gens = [batched_generation(engine, loaded, scheme, p, max_tokens=6, share=512) for p in prompts]
    rows = [next(g) for g in gens]
    assert all(isinstance(r, PrefillRow) for r in rows)
    assert [r.caches[0].offset for r in rows] == [0] * 5 + [len(stored)]  # the last one restored its prefix
    seconds = prefill_rows(loaded.model, rows)
    assert all(r.seconds == seconds > 0 for r in rows)
    for prompt, row in zip(prompts, rows):
        started = finish(engine.prompt_steps(loaded, scheme, prompt))[0]  # its prefill alone
        started.context.start_decoding()  # (the shared pass encodes fresh layers, in lockstep)
        for a, b in zip(row.caches, started.caches):
            assert getattr(a, "compressed", None) == getattr(b, "compressed", None)
            assert a.offset == b.offset == len(prompt) - 1
            for x, y in zip(a.state, b.state):
                assert mx.array_equal(x, y)
    results, _ = _step_all(DecodeBatch(), loaded, gens)
    for prompt, (result, _) in zip(prompts, results):
        alone = engine.generate(loaded, scheme, prompt, max_tokens=6)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)
        assert result.prefill_seconds == seconds and result.cached_tokens == alone.cached_tokens


@pytest.mark.exact_blas
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_batched_family_prefills_in_one_pass_as_alone(tmp_path, family):
    """The other families the server batches (their attention reads the cache's offset for RoPE
    and asks it for the mask, as llama's does): prompts of unequal length prefilled in one pass
    decode the tokens and first log-probabilities they decode alone."""
    folder = write_model_folder(tmp_path / family, kind=family)
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(folder))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:4]]
    gens = [batched_generation(engine, loaded, "raw", p, max_tokens=4, share=512) for p in prompts]
    prefill_rows(loaded.model, [next(g) for g in gens])
    results, _ = _step_all(DecodeBatch(), loaded, gens)
    for prompt, (result, _) in zip(prompts, results):
        alone = engine.generate(loaded, "raw", prompt, max_tokens=4)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)


def test_a_prompt_longer_than_the_share_prefills_on_its_own(tmp_path, llama):
    """Only prefills of at most `share` tokens are handed out; a longer one runs its own chunks."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompt = loaded.tokenizer.encode(PROMPTS[6])
    first = next(batched_generation(engine, loaded, "raw", prompt, max_tokens=2, share=len(prompt) - 2))
    assert first is None  # its first chunk ran
    row = next(batched_generation(engine, loaded, "raw", prompt, max_tokens=2, share=len(prompt) - 1))
    assert isinstance(row, PrefillRow) and row.tokens == prompt[:-1]


def test_a_step_runs_ahead_and_a_joining_row_waits_one_step(tmp_path, llama):
    """The next step is launched before a step's tokens are read: a row that joins is launched
    with the others and handed its token at the step after (unless no launched row is stepped),
    and a row's caches hold one token more than it was handed, as after Engine.generate."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[1:3]]
    a, b = _first_rows([batched_generation(engine, loaded, "raw", p, max_tokens=8) for p in prompts])
    batch = DecodeBatch(group_tokens=0)  # every row on its own caches, whose offsets tell the steps run
    assert batch.step(loaded.model, [a]) == [a]  # nothing launched: a's step runs at once
    assert a.caches[0].offset == len(prompts[0]) + 1  # its step, and the next one launched
    a.token = a.drawn
    assert batch.step(loaded.model, [a, b]) == [a]  # b joins the launch, a is handed the launched token
    assert b.drawn is None and b.caches[0].offset == len(prompts[1])
    a.token = a.drawn
    assert batch.step(loaded.model, [a, b]) == [a, b]
    assert b.drawn is not None and b.caches[0].offset == len(prompts[1]) + 1


@pytest.mark.exact_blas
@pytest.mark.parametrize("scheme", ["raw", "turbo4"])
def test_rows_that_sit_out_steps_run_ahead_for_them_answer_as_alone_sampled_too(tmp_path, llama, scheme):
    """A row that sits out the step launched for it has that step taken back: its token from
    its caches (or the group's buffers), and its draw from its random sequence, so seeded
    sampled answers, greedy ones and a compressed row's storage are those of the row alone."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:4]]
    options = [dict(temp=1.0, seed=5 + i) if i % 2 else {} for i in range(4)]
    gens = [batched_generation(engine, loaded, scheme, p, max_tokens=9, **o) for p, o in zip(prompts, options)]
    results, _ = _step_all(DecodeBatch(), loaded, gens,
                           absent=lambda step, i: i in (1, 2) and 2 <= step < 4 or i == 3 and step in (1, 5))
    for prompt, o, (result, caches) in zip(prompts, options, results):
        alone = engine.generate(loaded, scheme, prompt, max_tokens=9, **o)
        assert result.tokens == alone.tokens
        assert mx.array_equal(result.first_logprobs, alone.first_logprobs)


def test_settle_hands_back_what_a_step_ran_ahead_for_rows_that_did_not_finish(tmp_path, llama):
    """With nothing to step (every running request parked, say), the batch takes back the
    launched step of unfinished rows and hands the group's rows back to their caches: a row
    holds exactly the tokens it was handed, and keeps nothing of finished rows."""
    engine = Engine.open(tmp_path / "home")
    loaded = engine.model(str(llama))
    prompt = loaded.tokenizer.encode(PROMPTS[2])
    [row] = _first_rows([batched_generation(engine, loaded, "raw", prompt, max_tokens=8)])
    batch = DecodeBatch()
    for _ in range(3):
        assert batch.step(loaded.model, [row]) == [row]
        row.token = row.drawn
    assert row.caches[0].offset == len(prompt) - 1 and batch.members == [row]  # its rows are in the group
    batch.settle()
    assert batch.members == [] and batch._launched is None
    assert all(c.offset == len(prompt) - 1 + 3 for c in row.caches)  # the prompt's last token and two drawn
