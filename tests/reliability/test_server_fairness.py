"""One client cannot hold the server (issue 19, finding 7): a real `tqstore serve` subprocess on
a tiny model. A stream asking for 1e9 tokens is capped (--max-tokens-limit, by default the
model's context length), and while it runs, short requests beside it finish within a bound:
running jobs take turns on the one model thread instead of waiting for the long one to end.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time

import pytest

from model_folder import write_model_folder
from server_process import ServerProcess, parse_prometheus, request

# Greedy decoding of this prompt on the seed-0 tiny model repeats one printable token without
# reaching the end-of-sequence token (tests/test_server_lifecycle.py): only a cap or a
# disconnect ends it.
ENDLESS = "Slow one: abscond abscond abscond"
SHORT = {"prompt": "Quick?", "max_tokens": 2, "temperature": 0}
SHORT_BOUND_S = 10.0  # a short request alone takes well under a second here


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("fair") / "tiny-qwen2", kind="qwen2")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One server for the endless streams, --max-running 2: one stream leaves a slot for the
    short requests beside it, as the default 8 does; two hold every slot."""
    srv = ServerProcess(tmp_path_factory.mktemp("fair-home") / "home", tiny_model, "--no-save", "--max-running", "2")
    yield srv
    assert srv.stop() == 0, srv.log()


def _idle(server: ServerProcess) -> None:
    """Wait until the server runs no job: the streams of an earlier test, closed by their client,
    end once the server sees them gone."""
    deadline = time.monotonic() + 30
    while parse_prometheus(request(server, "GET", "/metrics")[2])["tqstore_running_jobs"] > 0:
        assert time.monotonic() < deadline, "the streams of an earlier test still run"
        time.sleep(0.1)


def _open_stream(server: ServerProcess, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # generating
    return conn, response


def test_a_billion_token_stream_does_not_starve_short_requests(server, ledger):
    _idle(server)
    long, stream = _open_stream(server, {"prompt": ENDLESS, "max_tokens": 10**9, "temperature": 0, "stream": True})
    try:
        for _ in range(3):
            t0 = time.monotonic()
            status, _, body = request(server, "POST", "/v1/completions", SHORT, timeout=SHORT_BOUND_S)
            seconds = time.monotonic() - t0
            assert status == 200 and body["usage"]["completion_tokens"] == 2, body
            assert seconds < SHORT_BOUND_S
            ledger.count("server/1e9-token stream beside short requests", "short request finished in bound")
        # The long one is still streaming: it was sliced, not stopped.
        events = [line for line in (stream.readline() for _ in range(40)) if line.strip()]
        assert len(events) == 20 and all(e.startswith(b"data: {") for e in events)
    finally:
        long.close()


def test_max_tokens_is_capped_by_the_server(tiny_model, tmp_path, ledger):
    server = ServerProcess(tmp_path / "home", tiny_model, "--no-save", "--max-tokens-limit", "16")
    try:
        for stream in (False, True):
            body = {"prompt": ENDLESS, "max_tokens": 10**9, "temperature": 0, "stream": stream,
                    "stream_options": {"include_usage": True}}
            if not stream:
                status, _, out = request(server, "POST", "/v1/completions", body)
                assert status == 200
                usage, finish = out["usage"], out["choices"][0]["finish_reason"]
            else:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                events = [json.loads(line[6:]) for line in conn.getresponse().read().decode().split("\n")
                          if line.startswith("data: {")]
                conn.close()
                usage = events[-1]["usage"]
                finish = next(e["choices"][0]["finish_reason"] for e in events if e["choices"]
                              and e["choices"][0]["finish_reason"])
            assert usage["completion_tokens"] == 16 and finish == "length", (usage, finish)
            ledger.count("server/1e9-token request with a cap", f"capped at the limit ({'stream' if stream else 'whole'})")
    finally:
        assert server.stop() == 0, server.log()


def test_short_requests_beside_max_running_endless_streams_are_answered(server, ledger):
    """Issue 27, finding 6: with --max-running endless streams holding every slot, a new request
    used to wait for one of them to end (0 of 4 answered in 40-90 s). A stream that has had its
    share of the model while others wait now steps aside (keeping its caches) and resumes later."""
    _idle(server)
    body = {"prompt": ENDLESS, "max_tokens": 10**9, "temperature": 0, "stream": True}
    streams = [_open_stream(server, body) for _ in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            def short(_):
                t0 = time.monotonic()
                status, _, out = request(server, "POST", "/v1/completions", SHORT, timeout=SHORT_BOUND_S)
                return status, out, time.monotonic() - t0

            for status, out, seconds in pool.map(short, range(3)):
                assert status == 200 and out["usage"]["completion_tokens"] == 2, out
                assert seconds < SHORT_BOUND_S
                ledger.count("server/--max-running endless streams beside short requests",
                             "short request answered")
        for _, stream in streams:  # both long ones still stream: parked and resumed, not stopped
            events = [line for line in (stream.readline() for _ in range(20)) if line.strip()]
            assert len(events) == 10 and all(e.startswith(b"data: {") for e in events)
    finally:
        for conn, _ in streams:
            conn.close()
