"""`tqstore serve` end to end: one real server subprocess for the module (tiny random-weight
model, an API key, a low save threshold), talked to with the openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import time

import openai
import pytest

from model_folder import write_model_folder
from server_process import ServerProcess, parse_prometheus, request

KEY = "test-key-123"
CONTEXT = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
           "The Devil's Dictionary defines words with wit. ") * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    # Two layers, not eight: what is checked is the server's, and every decode step costs a quarter.
    model = write_model_folder(root / "tiny-qwen2", kind="qwen2", num_hidden_layers=2)
    srv = ServerProcess(root / "home", model, "--save-min-tokens", "32", "--max-body-bytes", "65536",
                        "--max-tokens", "8", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for part in stream:
        if part.usage is not None:
            usage = part.usage
        for choice in part.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_healthz_is_open_and_models_list_the_served_model(server, client):
    status, _, body = request(server, "GET", "/healthz", key=None)
    assert status == 200 and body["status"] == "ok"
    assert [m.id for m in client.models.list()] == ["tiny-qwen2"]
    assert client.models.retrieve("tiny-qwen2").id == "tiny-qwen2"


def test_api_key_is_required_everywhere_but_healthz(server):
    for key in (None, "wrong"):
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/caches"), ("GET", "/metrics")):
            status, headers, body = request(server, method, path, key=key)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (key, path)
            assert body["error"]["code"] == "invalid_api_key"
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": "x"}, key="wrong")
    assert status == 401 and "incorrect API key" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert request(server, "GET", "/v1/models")[0] == 200


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_repeated_long_prompt_is_restored_and_decodes_the_same(client, chat):
    prompt = CONTEXT + ("Who pays for delays?" if chat else "Summarise clause seven.")

    def ask(stream: bool):
        if chat:
            args = dict(model="tiny-qwen2", messages=[{"role": "user", "content": prompt}], max_tokens=6,
                        temperature=0)
            if stream:
                return _stream_text(client.chat.completions.create(**args, stream=True,
                                                                   stream_options={"include_usage": True}))
            r = client.chat.completions.create(**args)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        args = dict(model="default", prompt=prompt, max_tokens=6, temperature=0)
        if stream:
            return _stream_text(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage

    first, first_finish, first_usage = ask(stream=False)
    assert first_usage.prompt_tokens >= 32 and first_usage.prompt_tokens_details.cached_tokens == 0
    assert first_usage.completion_tokens == 6 and first_finish == "length"
    again, _, usage = ask(stream=False)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert again == first
    streamed, finish, stream_usage = ask(stream=True)
    assert streamed == first and finish == "length"
    assert stream_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_raw_http_reports_the_tier_in_headers_and_usage(server):
    body = {"prompt": CONTEXT + "Raw HTTP asks who pays.", "max_tokens": 3, "temperature": 0}
    status, headers, first = request(server, "POST", "/v1/completions", body)
    assert status == 200 and headers["X-TQStore-Tier"] == "none" and headers["X-TQStore-Cached-Tokens"] == "0"
    assert first["object"] == "text_completion" and first["choices"][0]["text"]
    status, headers, second = request(server, "POST", "/v1/completions", body)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert headers["X-TQStore-Tier"] == "memory" and int(headers["X-TQStore-Cached-Tokens"]) == cached > 0
    assert second["tqstore"]["tier"] == "memory" and second["choices"] == first["choices"]
    # A stream says where its prompt came from in its headers, before the first token.
    status, headers, events = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["X-TQStore-Tier"] == "memory" and int(headers["X-TQStore-Cached-Tokens"]) == cached
    assert events.rstrip().endswith("data: [DONE]")


def test_stop_sequences_cut_the_answer_streamed_or_not(client):
    args = dict(model="tiny-qwen2", prompt="Who pays for delays? The contract says", max_tokens=8, temperature=0)
    full = client.completions.create(**args).choices[0].text
    assert len(full) >= 4
    stop = full[2:4]
    cut = client.completions.create(**args, stop=[stop, "never-there"])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed, finish, _ = _stream_text(client.completions.create(**args, stop=stop, stream=True))
    assert streamed == full[:full.find(stop)] and finish == "stop"


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, client):
    def check(method, path, status, words, code=None, **kwargs):
        got, _, body = request(server, method, path, **kwargs)
        assert got == status, (path, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
        if code:
            assert error["code"] == code

    check("POST", "/v1/completions", 400, "not valid JSON", raw=b"{not json")
    check("POST", "/v1/completions", 400, "body is empty", raw=b"")
    check("POST", "/v1/chat/completions", 400, "must be a JSON object", body=["a"])
    check("POST", "/v1/chat/completions", 400, "'messages'", body={"messages": []})
    check("POST", "/v1/completions", 400, "'max_tokens' must be at least 1", body={"prompt": "x", "max_tokens": 0})
    check("POST", "/v1/completions", 400, "'temperature' must be", body={"prompt": "x", "temperature": "hot"})
    check("POST", "/v1/completions", 404, "'gpt-4' is not served here", code="model_not_found",
          body={"prompt": "x", "model": "gpt-4"})
    check("POST", "/v1/completions", 413, "more than the server's limit of 65536",
          raw=json.dumps({"prompt": "x" * 100_000}).encode())
    check("GET", "/v1/caches/no-such-entry", 404, "no entry no-such-entry")
    check("DELETE", "/v1/caches/no-such-entry", 404, "no entry no-such-entry")
    # The store's message named its folder: a 404 gave the server's paths to any client.
    for method in ("GET", "DELETE"):
        got, _, body = request(server, method, "/v1/caches/no-such-entry")
        assert got == 404 and "store at" not in body["error"]["message"], body
    got, _, body = request(server, "POST", "/v1/completions", {"prompt": "Q", "documents": [{"name": "nope"}]})
    assert got == 404 and "nope" in body["error"]["message"] and "store at" not in body["error"]["message"], body
    check("GET", "/v1/caches/..%2F..%2Fetc", 400, "invalid entry name", code="invalid_name")
    check("PUT", "/v1/caches/-flag", 400, "invalid entry name", body={"prompt": "x"})
    check("GET", "/v1/nothing", 404, "no endpoint /v1/nothing")
    check("DELETE", "/v1/completions", 405, "DELETE is not allowed")
    with pytest.raises(openai.NotFoundError, match="not served here") as caught:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    r = client.completions.create(model="tiny-qwen2", prompt="Still serving?", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_cache_admin_put_get_reuse_pin_delete(server, client):
    prompt = CONTEXT + "An entry saved by name."
    status, _, info = request(server, "PUT", "/v1/caches/contract", {"prompt": prompt})
    assert status == 200 and info["name"] == "contract" and info["tokens"] > 30 and not info["pinned"]
    status, _, got = request(server, "GET", "/v1/caches/contract")
    assert status == 200 and got["tokens"] == info["tokens"]
    listed = request(server, "GET", "/v1/caches")[2]
    assert "contract" in [e["name"] for e in listed["data"]]
    reuse = client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=2)
    assert reuse.usage.prompt_tokens_details.cached_tokens == info["tokens"] == reuse.usage.prompt_tokens - 1

    assert request(server, "POST", "/v1/caches/contract/pin")[2]["pinned"] is True
    assert request(server, "POST", "/v1/caches/contract/pin", {"pinned": False})[2]["pinned"] is False
    request(server, "POST", "/v1/caches/contract/pin")
    assert request(server, "DELETE", "/v1/caches/contract/pin")[2]["pinned"] is False

    status, _, doc = request(server, "PUT", "/v1/caches/manual.v2",
                             {"document": CONTEXT, "system": "Answer briefly.", "pinned": True, "ttl": 3600})
    assert status == 200 and doc["pinned"] and doc["expires"] is not None
    status, _, chat = request(server, "PUT", "/v1/caches/chat_1", {"messages": [{"role": "user", "content": CONTEXT}]})
    assert status == 200 and chat["tokens"] > 30
    status, _, body = request(server, "PUT", "/v1/caches/x", {"prompt": "a", "document": "b"})
    assert status == 400 and "exactly one" in body["error"]["message"]

    for name in ("contract", "manual.v2", "chat_1"):
        status, _, body = request(server, "DELETE", f"/v1/caches/{name}")
        assert status == 200 and body == {"id": name, "object": "cache", "deleted": True}
    assert request(server, "GET", "/v1/caches/contract")[0] == 404
    assert "contract" not in [e["name"] for e in request(server, "GET", "/v1/caches")[2]["data"]]


def test_eight_concurrent_clients_get_what_they_get_alone(server):
    # Mostly sampled (seeded) requests, so outputs differ and any mix-up between requests shows;
    # half of the prompts are long enough to be stored by the first pass and restored after.
    bodies = [{"prompt": (CONTEXT if i % 2 else "") + f"Client {i} asks who pays.", "max_tokens": 6,
               "temperature": 0 if i % 3 == 0 else 0.9, "seed": 100 + i, "stream": i % 4 < 2} for i in range(8)]

    def run(body):
        if not body["stream"]:
            status, _, out = request(server, "POST", "/v1/completions", body)
            assert status == 200
            return out["choices"][0]["text"]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        events = [line[6:] for line in response.read().decode().split("\n") if line.startswith("data: ")]
        conn.close()
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    [run(b) for b in bodies]  # stores the long prompts: from now on every run restores them
    alone = [run(b) for b in bodies]
    assert len(set(alone)) > 1
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, bodies))
    assert together == alone


def test_metrics_are_prometheus_text_and_count_what_happened(server, client):
    before = parse_prometheus(request(server, "GET", "/metrics")[2])
    request(server, "GET", "/v1/models", key="wrong")
    prompt = CONTEXT + "Metrics count this."
    client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=2)
    client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=2)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    # A response goes out before its autosave is decided (on the model thread) and stored (on
    # the writer thread), so the counts arrive after it; on a loaded machine /metrics read at once
    # still lacked the second request's "covered" (or the first's put).
    deadline = time.monotonic() + 60
    while True:
        status, headers, text = request(server, "GET", "/metrics")
        after = parse_prometheus(text)
        settled = delta('tqstore_autosaves_total{outcome="covered"}') and delta("tqstore_autosave_seconds_count")
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert delta('tqstore_http_requests_total{endpoint="/v1/completions",method="POST",status="200"}') == 2
    assert delta('tqstore_http_requests_total{endpoint="/v1/models",method="GET",status="401"}') == 1
    assert delta('tqstore_prefix_hits_total{api="openai",tier="none"}') == 1
    assert delta('tqstore_prefix_hits_total{api="openai",tier="memory"}') == 1
    assert delta('tqstore_cached_tokens_total{api="openai"}') > 30
    assert delta('tqstore_autosaves_total{outcome="saved"}') == 1
    assert delta("tqstore_autosave_seconds_count") == 1 and delta("tqstore_autosave_seconds_sum") > 0
    assert delta('tqstore_autosaves_total{outcome="covered"}') == 1
    assert delta("tqstore_restore_seconds_count") == 1 and delta("tqstore_prefill_seconds_count") == 2
    assert after['tqstore_store_bytes{tier="lmdb"}'] > 0 and after['tqstore_store_entries{tier="lmdb"}'] >= 1
    assert after['tqstore_store_object_hits_total{tier="memory"}'] > 0
    assert after["tqstore_queue_depth"] == 0 and after["tqstore_queue_capacity"] == 32
    for name in ("tqstore_evicted_entries_total", "tqstore_evicted_bytes_total", "tqstore_memory_evictions_total",
                 "tqstore_rejected_requests_total", "tqstore_cancelled_requests_total"):
        assert name in after


def test_kept_alive_requests_do_not_wait_for_delayed_acks(server):
    # A response written as head then body, with Nagle on, waits for the client's delayed ACK:
    # 40 ms per request once the connection left TCP's quick-ACK start.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    seconds = []
    try:
        for _ in range(12):
            t0 = time.perf_counter()
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
            seconds.append(time.perf_counter() - t0)
    finally:
        conn.close()
    assert statistics.median(seconds[4:]) < 0.025, seconds
