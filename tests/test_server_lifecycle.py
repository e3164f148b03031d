"""`tqstore serve` across a restart, and its queue: clients that go away free their slot, a full
queue answers 503 with Retry-After. One home; a first server saves a prefix and stops on
SIGTERM, a second one (--max-queue 1 --max-running 1) serves the rest of the module."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from model_folder import write_model_folder
from server_process import REPO, ServerProcess, parse_prometheus, request

PROMPT = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
          "Who pays for delays?")
# Greedy decoding of this prompt on the seed-0 tiny model repeats one printable token without
# ever reaching the end-of-sequence token: a stream that only stops when cancelled.
ENDLESS = {"prompt": "Slow one: abscond abscond abscond", "max_tokens": 100_000, "temperature": 0, "stream": True}


@dataclass
class Restarted:
    server: ServerProcess
    body: dict
    first: dict  # the response of the first server
    first_exit: int
    cut_stream: bytes  # what a stream running at the SIGTERM read after its first chunk
    cut_whole: tuple  # (status, headers, body) of a whole response running at the SIGTERM


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    model = write_model_folder(root / "tiny-qwen2", kind="qwen2")
    home = root / "home"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = ServerProcess(home, model, "--save-min-tokens", "16")
    try:
        status, headers, response = request(first, "POST", "/v1/completions", body)
        assert status == 200 and headers["X-TQStore-Tier"] == "none"
        # Requests running when SIGTERM comes: a stream, and a whole response in a thread.
        stream = _open_stream(first, ENDLESS)
        whole: list = []
        waiting = threading.Thread(target=lambda: whole.append(
            request(first, "POST", "/v1/completions", {**ENDLESS, "stream": False}, timeout=60)))
        waiting.start()
        deadline = time.monotonic() + 30
        while _metrics(first)["tqstore_running_jobs"] < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.05)
    finally:
        first_exit = first.stop()
    waiting.join(60)
    cut = stream.sock.makefile("rb").read() if stream.sock else b""
    stream.close()
    second = ServerProcess(home, model, "--save-min-tokens", "16", "--max-queue", "1", "--max-running", "1")
    yield Restarted(second, body, response, first_exit, cut, whole[0] if whole else ())
    assert second.stop() == 0, second.log()


def _metrics(server) -> dict[str, float]:
    return parse_prometheus(request(server, "GET", "/metrics")[2])


def _open_stream(server, body: dict, wait_for_data: bool = True) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if wait_for_data:
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
    return conn


def _quick(server) -> float:
    """Seconds until a short request completes; 503s (the server may take a poll interval to see
    that a waiting client left) are retried as a client would."""
    t0 = time.monotonic()
    while True:
        status, _, body = request(server, "POST", "/v1/completions", {"prompt": "Quick?", "max_tokens": 2},
                                  timeout=30)
        if status != 503 or time.monotonic() - t0 > 10:
            break
        time.sleep(0.1)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    return time.monotonic() - t0


def test_sigterm_stops_the_server_cleanly(restarted):
    assert restarted.first_exit == 0


def test_requests_running_at_sigterm_end_with_shutting_down(restarted):
    # Before: cancelled without an event, the stream was cut with no error event, no [DONE]
    # and no end of its chunked body, and the whole response became a plain-text 500 after
    # uvicorn's 5-second grace.
    assert b'"code": "shutting_down"' in restarted.cut_stream, restarted.cut_stream[-500:]
    assert restarted.cut_stream.rstrip(b"\r\n0").endswith(b"data: [DONE]"), restarted.cut_stream[-500:]
    status, _, body = restarted.cut_whole
    assert status == 503 and body["error"]["code"] == "shutting_down", body


def test_a_restarted_server_restores_the_prefix_from_lmdb(restarted):
    server = restarted.server
    before = _metrics(server)
    status, headers, again = request(server, "POST", "/v1/completions", restarted.body)
    assert status == 200 and headers["X-TQStore-Tier"] == "lmdb"
    usage = again["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1 > 16
    assert again["choices"] == restarted.first["choices"]
    after = _metrics(server)
    key = 'tqstore_prefix_hits_total{api="openai",tier="lmdb"}'
    assert after[key] - before.get(key, 0) == 1
    assert after['tqstore_store_object_hits_total{tier="lmdb"}'] > 0


def test_a_client_that_disconnects_mid_stream_frees_its_slot(restarted):
    server = restarted.server
    before = _metrics(server)
    conn = _open_stream(server, ENDLESS)
    conn.close()
    assert _quick(server) < 10
    after = _metrics(server)
    assert after["tqstore_cancelled_requests_total"] - before["tqstore_cancelled_requests_total"] == 1


def test_a_full_queue_answers_503_with_retry_after(restarted):
    server = restarted.server
    before = _metrics(server)
    running = _open_stream(server, ENDLESS)
    waiting = _open_stream(server, ENDLESS, wait_for_data=False)
    deadline = time.monotonic() + 10
    while _metrics(server)["tqstore_queue_depth"] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)
    status, headers, body = request(server, "POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "queue_full" and "--max-queue 1" in body["error"]["message"]
    rejected = _metrics(server)["tqstore_rejected_requests_total"] - before["tqstore_rejected_requests_total"]
    assert rejected == 1
    running.close()
    waiting.close()
    assert _quick(server) < 10
    after = _metrics(server)
    assert after["tqstore_cancelled_requests_total"] - before["tqstore_cancelled_requests_total"] == 2
    assert after["tqstore_queue_depth"] == 0


def test_a_model_that_cannot_load_ends_the_server_with_the_reason(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    done = subprocess.run([sys.executable, "-m", "tqstore.serve", "--home", str(tmp_path / "home"), "--model",
                           str(tmp_path / "not-a-model"), "--port", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "not-a-model is not a model folder" in done.stderr and "tqstore serve: error:" in done.stderr
