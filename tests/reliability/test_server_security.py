"""Server security defaults (issue 19, finding 9), over real HTTP on loopback against a real
`tqstore serve` subprocess: a non-loopback bind without an API key is refused unless
--insecure; a web page cannot drive the keyless default server (a foreign Origin, or a foreign
Host as DNS rebinding sends, gets 403 and changes nothing); a client without the key is refused
before its body is read.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from model_folder import write_model_folder
from server_process import REPO, ServerProcess, request

KEY = "security-test-key"
DOC = {"document": "The seller pays for delays."}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("security") / "tiny-qwen2", kind="qwen2")


@pytest.fixture(scope="module")
def keyless(tiny_model, tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("keyless") / "home", tiny_model, "--no-save")
    status, _, _ = request(server, "PUT", "/v1/caches/kept", DOC)
    assert status == 200
    yield server
    assert server.stop() == 0, server.log()


def _serve(model, home, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TQSTORE_API_KEY"}
    return subprocess.Popen([sys.executable, "-m", "tqstore.serve", "--home", str(home), "--model", str(model),
                             "--port", "0", *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_public_bind_without_a_key_is_refused(host, tiny_model, tmp_path, ledger):
    proc = _serve(tiny_model, tmp_path / "home", "--host", host)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it serves: the refusal is missing
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 1 and "listening" not in out, (out, err)
    assert "no API key is set" in err and "--insecure" in err and "TQSTORE_API_KEY" in err, err
    ledger.count("server/public bind without a key", f"refused ({host})")


def test_insecure_says_so_and_serves(tiny_model, tmp_path, ledger):
    proc = _serve(tiny_model, tmp_path / "home", "--host", "0.0.0.0", "--insecure")
    try:
        line = proc.stdout.readline()
        assert "listening on http://0.0.0.0:" in line, line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "--insecure" in err, err
    ledger.count("server/public bind without a key", "--insecure serves, with a warning")


FOREIGN = [
    ("cross-origin text/plain POST", "POST", "/v1/completions", {"Origin": "http://evil.example",
                                                                  "Content-Type": "text/plain"}),
    ("cross-origin PUT", "PUT", "/v1/caches/planted", {"Origin": "http://evil.example"}),
    ("null origin", "POST", "/v1/completions", {"Origin": "null"}),
    ("same host, other port", "POST", "/v1/completions", {"Origin": "http://127.0.0.1:1"}),
    ("rebound read", "GET", "/v1/caches", {"Host": "evil.example"}),
    ("rebound read with port", "GET", "/v1/caches/kept", {"Host": "evil.example:{port}"}),
    ("rebound PUT", "PUT", "/v1/caches/planted", {"Host": "evil.example:{port}"}),
    ("rebound DELETE", "DELETE", "/v1/caches/kept", {"Host": "evil.example:{port}"}),
]


@pytest.mark.parametrize("label,method,path,headers", FOREIGN, ids=[f[0] for f in FOREIGN])
def test_a_web_page_cannot_drive_the_keyless_server(label, method, path, headers, keyless, ledger):
    sent = {k: v.format(port=keyless.port) for k, v in headers.items()}
    body = {"prompt": "Who pays?", "max_tokens": 2} if path == "/v1/completions" else DOC
    status, _, out = request(keyless, method, path, None if method in ("GET", "DELETE") else body, headers=sent)
    assert status == 403 and out["error"]["code"] in ("forbidden_origin", "forbidden_host"), (label, status, out)
    names = [e["name"] for e in request(keyless, "GET", "/v1/caches")[2]["data"]]
    assert names == ["kept"], names  # nothing planted, nothing deleted
    ledger.count("server/foreign Origin or Host", "403, store unchanged")


@pytest.mark.parametrize("headers", [{}, {"Host": "localhost:{port}"}, {"Origin": "http://127.0.0.1:{port}"},
                                     {"Host": "localhost:{port}", "Origin": "http://localhost:{port}"}],
                         ids=["no origin", "localhost", "same origin", "localhost origin"])
def test_its_own_origin_and_loopback_names_are_served(headers, keyless, ledger):
    sent = {k: v.format(port=keyless.port) for k, v in headers.items()}
    status, _, out = request(keyless, "POST", "/v1/completions", {"prompt": "Who pays?", "max_tokens": 2},
                             headers=sent)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    ledger.count("server/foreign Origin or Host", "own origin served")


def test_no_body_is_read_before_the_key_is_checked(tiny_model, tmp_path, ledger):
    server = ServerProcess(tmp_path / "home", tiny_model, "--no-save", api_key=KEY)
    try:
        for path in ("/v1/caches/big", "/v1/completions"):
            # Headers announcing 16 MiB, and no body: the 401 must come without waiting for it.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {16 << 20}\r\n\r\n".encode())
                t0 = time.monotonic()
                reply = sock.recv(4096)
                assert reply.startswith(b"HTTP/1.1 401 "), reply[:200]
                assert time.monotonic() - t0 < 5
            ledger.count("server/unauthenticated body", "401 before reading the body")
        status, _, out = request(server, "PUT", "/v1/caches/small", DOC, key=None)
        assert status == 401 and "Bearer" in out["error"]["message"]
        assert request(server, "GET", "/v1/caches")[2]["data"] == []
        ledger.count("server/unauthenticated body", "401, nothing stored")
    finally:
        assert server.stop() == 0, server.log()


def test_which_binds_are_loopback_and_which_hosts_are_allowed():
    from tqstore.serve.http import _hostname
    from tqstore.serve.options import allowed_hosts, is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST")] == [True] * 6
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "my-host", "localhost.evil.example"))
    assert allowed_hosts("127.0.0.1", []) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("192.168.1.5", ["Proxy.Example"]) == {"localhost", "127.0.0.1", "::1", "192.168.1.5",
                                                               "proxy.example"}
    assert allowed_hosts("0.0.0.0", []) is None and "api.example" in allowed_hosts("::", ["api.example"])
    assert [_hostname(h) for h in ("LocalHost:8080", "[::1]:80", "::1", "127.0.0.1", "evil.example:1")] == [
        "localhost", "::1", "::1", "127.0.0.1", "evil.example"]
