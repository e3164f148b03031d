"""Hostile clients against a real `tqstore serve` subprocess on loopback (issue 20: the server
on uvicorn must hold at least as well as it did on http.server): clients that connect and say
nothing, or send their request a byte at a time, are dropped after --keep-alive and do not
delay anyone else; a stalled body gets 408; a huge announced body gets 413 before any of it is
read; a flood of connections is answered, with 503 beyond --max-connections.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import socket
import threading
import time

import pytest

from model_folder import write_model_folder
from server_process import ServerProcess, request

KEEP_ALIVE = 3  # seconds; --keep-alive
MAX_CONNECTIONS = 32
SHORT = {"prompt": "Quick?", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = write_model_folder(root / "tiny-qwen2", kind="qwen2")
    srv = ServerProcess(root / "home", model, "--no-save", "--keep-alive", str(KEEP_ALIVE), "--max-connections",
                        str(MAX_CONNECTIONS))
    yield srv
    assert srv.stop() == 0, srv.log()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (whatever it sends first is skipped)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def _reply(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) read from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        got = sock.recv(4096)
        if not got:
            break
        data += got
    return data


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_silent_and_trickling_clients_are_dropped_and_delay_nobody(server, ledger):
    silent = [_connect(server) for _ in range(10)]
    partial = [_connect(server) for _ in range(10)]
    for sock in partial:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    trickler = _connect(server)
    stop = threading.Event()

    def trickle():  # a header byte every 0.2 s, for longer than the keep-alive
        try:
            for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 200:
                if stop.wait(0.2):
                    return
                trickler.sendall(bytes([byte]))
        except OSError:  # closed by the server: the point
            pass

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        status, _, body = request(server, "POST", "/v1/completions", SHORT, timeout=10)
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        ledger.count("server/slow clients", "normal request beside 21 slow ones served")
        for sock in [*silent, *partial, trickler]:
            assert _closed_within(sock, KEEP_ALIVE + 5), "a slow client kept its connection"
        ledger.count("server/slow clients", "dropped after --keep-alive", 21)
    finally:
        stop.set()
        for sock in [*silent, *partial, trickler]:
            sock.close()


def test_a_trickling_body_gets_408_within_its_deadline(server, ledger):
    """Issue 27, finding 6: a body sent a byte a second never stalls for --keep-alive, and was
    read for as long as it trickled (90 s at a byte every 4 s with --keep-alive 5). The whole
    body now has a deadline: --keep-alive, plus its length at a minimum rate."""
    with _connect(server) as sock:
        sock.sendall(b"PUT /v1/caches/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
        stop = threading.Event()

        def trickle():
            try:
                while not stop.wait(1.0):
                    sock.sendall(b"a")
            except OSError:  # closed by the server: the point
                pass

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        t0 = time.monotonic()
        try:
            sock.settimeout(KEEP_ALIVE + 5)
            reply = _reply(sock)
            assert _closed_within(sock, 2), "the connection stayed open after the 408"
        finally:
            stop.set()
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < KEEP_ALIVE + 3, reply[:200]
    assert b'"code":"timeout"' in reply
    ledger.count("server/slow clients", "trickling body: 408 at its deadline")


def test_a_stalled_body_gets_408(server, ledger):
    with _connect(server) as sock:
        sock.sendall(b"PUT /v1/caches/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"doc")
        sock.settimeout(KEEP_ALIVE + 5)
        reply = _reply(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b'"code":"timeout"' in reply
    ledger.count("server/slow clients", "stalled body: 408")


def test_a_huge_body_gets_413_before_it_is_read(server, ledger):
    with _connect(server) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {1 << 40}\r\n"
                     "Content-Type: application/json\r\n\r\n".encode() + b"{" * 65536)
        t0 = time.monotonic()
        reply = _reply(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and time.monotonic() - t0 < 5, reply[:200]
    assert b'"code":"body_too_large"' in reply
    ledger.count("server/huge body", "1 TiB announced: 413 before reading it")
    assert request(server, "GET", "/healthz")[0] == 200


def test_a_flood_is_answered_and_connections_beyond_the_limit_get_503(server, ledger):
    def health(_):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(health, range(300)))
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0, statuses
    ledger.count("server/flood", "300 requests on 64 connections at a time: 200, or 503 past the limit", 300)

    # Requests in progress, reading a body (not idle: they cannot make room). uvicorn serves a
    # request while fewer than --max-connections connections are open, its own included.
    held = []
    try:
        for _ in range(MAX_CONNECTIONS - 1):
            held.append(_connect(server))
            held[-1].sendall(b"PUT /v1/caches/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.02)  # its head read before the next connection is counted
        status, _, _ = request(server, "GET", "/healthz", timeout=10)
        assert status == 503
        ledger.count("server/flood", "beyond --max-connections busy ones: 503 at once")
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while request(server, "GET", "/healthz")[0] != 200:
        assert time.monotonic() < deadline, "the server did not recover from the flood"
        time.sleep(0.1)


@pytest.mark.parametrize("piece", [1 << 20, 4096], ids=["at once", "in pieces"])
def test_a_huge_request_head_is_refused_and_the_server_keeps_serving(piece, server, ledger):
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: " + b"a" * (100 << 10) + b"\r\n\r\n"
    with _connect(server) as sock:
        try:
            for i in range(0, len(head), piece):
                sock.sendall(head[i:i + piece])
        except OSError:  # refused and closed before the rest was sent
            pass
        reply = _reply(sock)
    # 431 from the server when the head came in whole, 400 from h11 when it came in pieces.
    assert reply.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 ")), reply[:200]
    assert request(server, "GET", "/healthz")[0] == 200
    ledger.count("server/huge head", "100 KiB header: 431 or 400, server kept serving")


def test_idle_unauthenticated_connections_do_not_lock_out_anyone(tmp_path, ledger):
    """Issue 27, finding 6: 1,100 idle sockets (no request, or an unfinished head, or a refused
    one) made every request 503 past --max-connections until --keep-alive dropped them. Now a
    new connection past the limit makes room by closing the idle one that waited longest, those
    that never sent an authorized request first: /healthz answers, and an authorized client's
    idle kept-alive connection survives the flood."""
    model = write_model_folder(tmp_path / "tiny-qwen2", kind="qwen2")
    server = ServerProcess(tmp_path / "home", model, "--no-save", "--keep-alive", "30", "--max-connections", "16",
                           api_key="sesame")
    kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    flood: list[socket.socket] = []
    try:
        kept.request("GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert kept.getresponse().read() and True
        for i in range(12):  # refused (401), then idle: the limit is not reached yet
            flood.append(_connect(server))
            flood[-1].sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _reply(flood[-1]).startswith(b"HTTP/1.1 401 ")
        for i in range(36):  # silent, or an unfinished head
            flood.append(_connect(server))
            if i % 2:
                flood[-1].sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(1.2)  # idle long enough to be closed for room (main.IDLE_GRACE_SECONDS)
        for _ in range(3):
            assert request(server, "GET", "/healthz", timeout=10)[0] == 200
            assert request(server, "GET", "/v1/models", key="sesame", timeout=10)[0] == 200
        kept.request("GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert kept.getresponse().status == 200
        ledger.count("server/idle connections", "48 idle unauthorized sockets past --max-connections 16: served")
    finally:
        kept.close()
        for sock in flood:
            sock.close()
        assert server.stop() == 0, server.log()
