"""The server's pieces without a server: request validation, stop sequences, error mapping,
the save policy's names, prompt encoding and the Prometheus text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server_process import parse_prometheus
from tqstore.errors import BadInput, DiskFull, InvalidName, NotFound, TqstoreError
from tqstore.serve.metrics import RATE_WINDOW_SECONDS, Metrics, QueueState
from tqstore.serve.openai_schema import (ApiError, Generation, Sampling, StopScanner, api_error, check_model,
                                parse_cache_source, parse_generation, parse_pin)
from tqstore.serve.autosave import SavePolicy
from tqstore.serve.prompts import completion_tokens

DEFAULTS = Sampling(max_tokens=16, temperature=0.0, top_p=1.0, seed=None, stop=())


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_the_first():
    scanner = StopScanner(("END", "xyz"))
    assert scanner.feed("hello E") == "hello "  # "E" may start "END"
    assert scanner.feed("hello EN") == ""
    assert scanner.feed("hello ENa") == "ENa"  # it did not
    assert scanner.end is None
    assert scanner.feed("hello ENa and END more") == " and "
    assert scanner.end == len("hello ENa and ")
    assert scanner.final("hello ENa and END more") == "hello ENa and "
    assert scanner.flush("hello ENa and END more") == ""
    plain = StopScanner(())
    assert plain.feed("abc") == "abc" and plain.flush("abcd") == "d" and plain.final("abcd") == "abcd"


def test_generation_requests_take_defaults_and_name_the_bad_field():
    r = parse_generation({"prompt": "hi"}, chat=False, defaults=DEFAULTS)
    assert r.prompt == "hi" and r.sampling == DEFAULTS and not r.stream and r.model is None
    r = parse_generation({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
                          "max_completion_tokens": 3, "stop": "\n", "stream": True,
                          "stream_options": {"include_usage": True}, "seed": 7}, chat=True, defaults=DEFAULTS)
    assert r.messages[0]["content"] == "ab" and r.sampling.max_tokens == 3 and r.sampling.stop == ("\n",)
    assert r.include_usage and r.sampling.seed == 7
    assert parse_generation({"prompt": [1, 2, 3]}, chat=False, defaults=DEFAULTS).prompt == (1, 2, 3)
    for body, param in (({"prompt": "x", "max_tokens": True}, "max_tokens"),
                        ({"prompt": "x", "top_p": 0}, "top_p"),
                        ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
                        ({"prompt": "x", "seed": 1.5}, "seed"),
                        ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": "x", "n": 2}, "n"),
                        ({"prompt": "x", "logprobs": 2}, "logprobs"),
                        ({}, "prompt")):
        with pytest.raises(ApiError) as caught:
            parse_generation(body, chat=False, defaults=DEFAULTS)
        assert caught.value.status == 400 and caught.value.param == param, body
    with pytest.raises(ApiError, match="only text parts"):
        parse_generation({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True,
                         defaults=DEFAULTS)


def test_cache_bodies_and_pin_bodies():
    assert parse_cache_source({"prompt": "p", "ttl": 60}).ttl == 60
    doc = parse_cache_source({"document": "d", "system": "s", "pinned": True})
    assert (doc.document, doc.system, doc.pinned) == ("d", "s", True)
    for body in ({}, {"prompt": "p", "messages": []}, {"prompt": "p", "system": "s"}, {"prompt": "p", "ttl": 0}, []):
        with pytest.raises(ApiError):
            parse_cache_source(body)
    assert parse_pin(None) is True and parse_pin({"pinned": False}) is False
    with pytest.raises(ApiError):
        parse_pin({"pinned": "no"})


def test_models_are_matched_by_name_default_or_absence():
    for name in (None, "default", "tiny", "/models/tiny"):
        check_model(name, ("tiny", "/models/tiny"))
    with pytest.raises(ApiError) as caught:
        check_model("gpt-4", ("tiny",))
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


def test_errors_map_to_statuses_and_bugs_do_not_leak_details():
    assert api_error(NotFound("no entry x")).status == 404
    assert api_error(InvalidName("bad")).status == 400
    assert api_error(BadInput("empty")).status == 400
    assert api_error(DiskFull("full")).status == 507
    assert api_error(TqstoreError("odd")).status == 500
    bug = api_error(KeyError("secret/path"))
    assert bug.status == 500 and "secret" not in bug.message and "KeyError" in bug.message
    assert set(bug.body()["error"]) == {"message", "type", "param", "code"}


def test_auto_names_are_deterministic_and_differ_by_model_scheme_and_tokens():
    name = SavePolicy.name_for(b"m" * 32, "turbo4", [1, 2, 3])
    assert name == SavePolicy.name_for(b"m" * 32, "turbo4", [1, 2, 3]) and name.startswith("auto-")
    assert len(name) == len("auto-") + 16
    others = {SavePolicy.name_for(b"n" * 32, "turbo4", [1, 2, 3]), SavePolicy.name_for(b"m" * 32, "raw", [1, 2, 3]),
              SavePolicy.name_for(b"m" * 32, "turbo4", [1, 2, 4])}
    assert name not in others and len(others) == 3


class _Tokenizer:
    bos_token = "<s>"

    def encode(self, text, add_special_tokens):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_completion_prompts_get_special_tokens_unless_they_start_with_bos():
    assert completion_tokens(_Tokenizer(), "ab") == [0, 97, 98]
    assert completion_tokens(_Tokenizer(), "<s>a")[0] == ord("<")
    assert completion_tokens(_Tokenizer(), (5, 6)) == [5, 6]


def test_metrics_render_valid_prometheus_text():
    metrics = Metrics()
    metrics.request("/v1/completions", "POST", 200)
    metrics.request("/v1/caches/{name}", "GET", 404)
    metrics.generated(Generation("x", "length", 40, 4, 39, "lmdb", 0.01, 0.02, 0.3))
    metrics.saved("saved", 0.05)
    tier = SimpleNamespace(bytes=10, objects=2, entries=1, budget=100, hits=3)
    stats = SimpleNamespace(tiers={"memory": SimpleNamespace(**{**vars(tier), "entries": None}), "lmdb": tier},
                            misses=0, evicted_entries=1, evicted_objects=2, evicted_bytes=30, memory_evictions=4)
    samples = parse_prometheus(metrics.render(stats, QueueState(waiting=2, capacity=8, running=1)))
    assert samples['tqstore_http_requests_total{endpoint="/v1/caches/{name}",method="GET",status="404"}'] == 1
    assert samples['tqstore_prefix_hits_total{api="openai",tier="lmdb"}'] == 1
    assert samples['tqstore_cached_tokens_total{api="openai"}'] == 39
    assert samples['tqstore_restore_seconds_bucket{le="0.01"}'] == 1 and samples["tqstore_restore_seconds_count"] == 1
    assert samples['tqstore_restore_seconds_bucket{le="0.005"}'] == 0
    assert samples["tqstore_queue_depth"] == 2 and samples["tqstore_evicted_bytes_total"] == 30
    assert 'tqstore_store_entries{tier="memory"}' not in samples
    assert samples['tqstore_store_entries{tier="lmdb"}'] == 1


def test_metrics_count_decode_batches_and_hits_per_api():
    metrics = Metrics()
    metrics.generated(Generation("x", "stop", 40, 4, 39, "memory", 0.01, 0.02, 0.3), "anthropic")
    metrics.generated(Generation("x", "stop", 40, 4, 0, "none", 0.0, 0.02, 0.3))
    for rows in (1, 3, 8):
        metrics.decoded(rows, 0.02)
    stats = SimpleNamespace(tiers={}, misses=0, evicted_entries=0, evicted_objects=0, evicted_bytes=0,
                            memory_evictions=0)
    samples = parse_prometheus(metrics.render(stats, QueueState(3, 32, 8, batching=True)))
    assert samples['tqstore_prefix_hits_total{api="anthropic",tier="memory"}'] == 1
    assert samples['tqstore_prefix_hits_total{api="openai",tier="none"}'] == 1
    assert samples['tqstore_prefix_hits_total{api="openai",tier="memory"}'] == 0
    assert samples['tqstore_cached_tokens_total{api="anthropic"}'] == 39
    assert samples['tqstore_cached_tokens_total{api="openai"}'] == 0
    # One counter per thing counted: the per-API figures are labels, not a second series to keep in step.
    assert not any(name.startswith("tqstore_api_") for name in samples)
    assert samples["tqstore_batch_size_count"] == 3 and samples["tqstore_batch_size_sum"] == 12
    assert samples['tqstore_batch_size_bucket{le="2.0"}'] == 1 and samples['tqstore_batch_size_bucket{le="4.0"}'] == 2
    assert samples["tqstore_decode_tokens_per_second"] == 12 / RATE_WINDOW_SECONDS  # 12 tokens in the window
    assert samples["tqstore_batching"] == 1 and samples["tqstore_queue_depth"] == 3


def test_two_servers_in_one_process_count_apart():
    first, second = Metrics(), Metrics()  # one registry each: the second does not collide with the first
    first.request("/healthz", "GET", 200)
    stats = SimpleNamespace(tiers={}, misses=0, evicted_entries=0, evicted_objects=0, evicted_bytes=0,
                            memory_evictions=0)
    key = 'tqstore_http_requests_total{endpoint="/healthz",method="GET",status="200"}'
    assert parse_prometheus(first.render(stats, QueueState(0, 1, 0)))[key] == 1
    assert key not in parse_prometheus(second.render(stats, QueueState(0, 1, 0)))


def test_requests_arriving_at_an_idle_server_fill_its_free_places_before_the_queue():
    """Before: with --max-queue 1 and 8 free running places, the second of 9 requests sent
    together was refused (503 queue_full): the model thread had not moved the first into a place."""
    from tqstore.serve.jobs import Job, QueueFull, Running
    from tqstore.serve.scheduling import Scheduler

    scheduler = Scheduler(capacity=1, max_running=8, metrics=Metrics())

    def job() -> Job:
        return Job("generate", lambda j: iter(()), lambda event: None)

    for _ in range(9):  # 8 places and 1 in the queue, none taken yet
        scheduler.submit(job())
    with pytest.raises(QueueFull):
        scheduler.submit(job())
    busy = Scheduler(capacity=1, max_running=2, metrics=Metrics())
    busy._running.extend(Running(job(), iter(())) for _ in range(2))  # both places taken
    busy.submit(job())
    with pytest.raises(QueueFull):
        busy.submit(job())


def test_a_bad_content_block_is_named_not_called_a_bad_string():
    from tqstore.serve.anthropic_schema import parse_messages

    # An image block (or a text block without text) was refused as "'messages[0].content' must
    # be a valid string": the string branch's error of `str | list[block]`.
    for block, said in (({"type": "image", "source": {}}, "'image'"), ({"type": "text"}, "text")):
        with pytest.raises(ApiError) as caught:
            parse_messages({"max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}, defaults=DEFAULTS)
        error = caught.value
        assert error.status == 400 and error.param == "messages" and said in error.message, error.message
        assert "valid string" not in error.message, error.message
