"""A fault-injecting HTTP proxy on loopback in front of the moto S3 server.

The store talks to the proxy's endpoint; the proxy relays each request to moto unless a fault
rule matches it. Faults: an S3 error status (500 InternalError, 503 SlowDown, injected 412
PreconditionFailed or 409 ConditionalRequestConflict races), a timeout (no answer until the
client gives up), a late answer (the request reaches moto, the answer comes after the client
gave up: a write that happened although the client saw it fail), a slow answer, a dropped
connection (no answer at all), a response cut off mid-body, and the server down (`stop()`: the
port refuses connections until `start()`).

Every request is counted by method and kind ("object", "manifest", "list", "other"), with its
outcome, so tests can prove that a resumed push does not upload a finished block again.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
        "expect", "content-length"}
_ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"


@dataclass
class Fault:
    """One rule: requests matching `method` and `kind` (None: any), after the first `after`
    matches, get `action` `times` times (None: every time)."""

    action: str  # "status", "timeout", "late", "slow", "drop", "cut"
    method: str | None = None
    kind: str | None = None
    times: int | None = None
    after: int = 0
    status: int = 500
    code: str = "InternalError"
    delay: float = 0.0
    seen: int = 0
    applied: int = 0

    def take(self, method: str, kind: str) -> bool:
        """Whether this request gets the fault (and count it)."""
        if (self.method not in (None, method)) or (self.kind not in (None, kind)):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and self.applied >= self.times):
            return False
        self.applied += 1
        return True


@dataclass
class Record:
    method: str
    kind: str
    path: str
    outcome: str  # "relayed <status>" or the fault's action
    body_bytes: int = 0


@dataclass
class S3Proxy:
    """The proxy: `endpoint` for the store, `inject` faults, `records` of every request."""

    upstream: str
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._sockets: set[socket.socket] = set()  # open client connections (keep-alive)
        self.port = 0
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (again, on the same port once one was chosen)."""
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = None
        for _ in range(50):  # the port of a stopped proxy may take a moment to be free again
            try:
                server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
                break
            except OSError:
                time.sleep(0.1)
        assert server is not None, f"cannot listen on 127.0.0.1:{self.port}"
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        # `stop` waits for the serving loop to notice, which it checks every poll interval
        # (0.5 s by default: a test paid it at every outage and teardown).
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="s3-proxy",
                         daemon=True).start()

    def stop(self) -> None:
        """The server goes down: open connections are closed and new ones refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, action: str, **rule: object) -> Fault:
        fault = Fault(action, **rule)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def reset_counts(self) -> None:
        with self._lock:
            self.records.clear()

    def count(self, method: str | None = None, kind: str | None = None, outcome: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.records if method in (None, r.method) and kind in (None, r.kind)
                       and (outcome is None or r.outcome.startswith(outcome)))

    def paths(self, method: str, kind: str, outcome: str = "relayed 200") -> Counter:
        """How often each path got `outcome` for `method` and `kind` requests."""
        with self._lock:
            return Counter(r.path.split("?")[0] for r in self.records
                           if (r.method, r.kind) == (method, kind) and r.outcome == outcome)

    def _match(self, method: str, kind: str) -> Fault | None:
        with self._lock:
            return next((f for f in self.faults if f.take(method, kind)), None)

    def _record(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)


def kind_of(path: str) -> str:
    if "/objects/" in path or "/packs/" in path:  # layout 1 objects, layout 2 packs
        return "object"
    if "/manifests/" in path:
        return "manifest"
    if "list-type" in path or "prefix=" in path:
        return "list"
    return "other"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive like a real endpoint; 100-continue is answered
    owner: S3Proxy

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._sockets.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the proxy went down under this connection

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _relay(self) -> None:
        proxy = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        kind = kind_of(self.path)
        fault = proxy._match(self.command, kind)
        record = Record(self.command, kind, self.path, fault.action if fault else "", len(body))
        proxy._record(record)
        if fault is not None and fault.action in ("timeout", "drop"):
            if fault.action == "timeout":
                time.sleep(fault.delay)
            self._hang_up()
            return
        if fault is not None and fault.action == "status":
            record.outcome = f"status {fault.status}"
            self._answer(fault.status, {"Content-Type": "application/xml"},
                         _ERROR.format(code=fault.code, message="injected by the test proxy").encode())
            return
        if fault is not None and fault.action == "slow":
            time.sleep(fault.delay)
        status, headers, data = self._upstream(body)
        if fault is not None and fault.action == "late":
            record.outcome = f"late {status}"
            time.sleep(fault.delay)
            self._hang_up()
            return
        if fault is not None and fault.action == "cut" and self.command == "GET" and len(data) > 1:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self._hang_up()
            return
        record.outcome = f"relayed {status}"
        self._answer(status, dict(headers), data)

    def _upstream(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.owner._upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP]
            if self.command == "HEAD":  # a HEAD's length is the object's, not this empty body's
                kept += [(k, v) for k, v in response.getheaders() if k.lower() == "content-length"]
            return response.status, kept, data
        finally:
            conn.close()

    def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if not any(name.lower() == "content-length" for name in headers):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
