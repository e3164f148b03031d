"""The HTTP layer of the OpenAI-compatible server (routing, bodies, auth, responses, streams);
`server.py` runs it. docs/server.md describes the API.

The work lives elsewhere: openai_api.py validates requests and shapes responses, serving.py
runs every model job on one owner thread behind a bounded queue, metrics.py renders the
counters, and the engine and the store do the rest. HTTP threads never touch MLX: they read
and write the store's catalog (list, info, remove, pin) and wait for their job's events.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import socket
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from tqstore.errors import TqstoreError
from tqstore.serve.streams import ClientGone, EventStream, JobWatch
from tqstore.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from tqstore.serve.metrics import Metrics
from tqstore.names import validate_name
from tqstore.serve.openai_schema import (ApiError, ResponseIds, Sampling, api_error, check_model, chunk, completion_response,
                         parse_cache_source, parse_generation, parse_pin, store_details, usage_chunk)
from tqstore.serve.worker import Failed, Finished, Job, ModelWorker, QueueFull, Text

log = logging.getLogger("tqstore.serve")
DISCARD_LIMIT = 64 << 20  # refused bodies up to this size are read and dropped before the 413
# Bodies of requests refused before reading (no key, foreign Origin) are dropped up to this size,
# so small clients read the error instead of a reset; larger ones are not read at all.
UNREAD_DISCARD_LIMIT = 64 << 10
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")

# (path pattern, route template for metrics, method -> handler name); the first match wins.
ROUTES: tuple[tuple[re.Pattern[str], str, dict[str, str]], ...] = tuple(
    (re.compile(pattern), template, methods) for pattern, template, methods in (
        (r"/healthz", "/healthz", {"GET": "healthz"}),
        (r"/metrics", "/metrics", {"GET": "metrics"}),
        (r"/v1/models", "/v1/models", {"GET": "models"}),
        (r"/v1/models/(?P<model>.+)", "/v1/models/{model}", {"GET": "model"}),
        (r"/v1/completions", "/v1/completions", {"POST": "completions"}),
        (r"/v1/chat/completions", "/v1/chat/completions", {"POST": "chat_completions"}),
        (r"/v1/caches", "/v1/caches", {"GET": "list_caches"}),
        (r"/v1/caches/(?P<name>.+)/pin", "/v1/caches/{name}/pin", {"POST": "pin", "DELETE": "unpin"}),
        (r"/v1/caches/(?P<name>.+)", "/v1/caches/{name}",
         {"GET": "get_cache", "PUT": "put_cache", "DELETE": "delete_cache"}),
    ))


@dataclass
class App:
    """What every request handler shares."""

    worker: ModelWorker
    metrics: Metrics
    model_id: str  # what /v1/models lists
    model_names: tuple[str, ...]  # what requests may name (besides "default")
    defaults: Sampling
    api_key: str | None
    max_body_bytes: int
    started: int
    # Names the Host header (and a browser's Origin) may use; None accepts any (a wildcard bind
    # without --allowed-host: the API key, which such a bind requires, is the guard).
    allowed_hosts: frozenset[str] | None = frozenset(LOOPBACK_NAMES)

    @property
    def store(self):
        return self.worker.engine.store


class Handler(BaseHTTPRequestHandler):
    """One connection; each request is routed to a `_<handler>` method."""

    protocol_version = "HTTP/1.1"  # keep-alive, and chunked streams
    server_version = "tqstore"
    timeout = 300  # seconds an idle keep-alive connection (or a stalled read or write) is kept
    server: "HttpServer"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # Answered with 405 (JSON, with Allow) rather than http.server's HTML 501.
    do_HEAD = do_PATCH = do_OPTIONS = lambda self: self._dispatch(self.command)  # noqa: E731

    @property
    def app(self) -> App:
        return self.server.app

    def _dispatch(self, method: str) -> None:
        self._status = 0
        self._body_left = True  # until _read_body: a refusal must not leave it in the stream
        endpoint = "unmatched"
        try:
            self._check_host()  # before anything: a DNS-rebound or cross-site page gets nothing
            path = urlsplit(self.path).path
            endpoint, methods, params = _match(path)
            if endpoint != "/healthz":
                self._authorize()  # before the body, 404 and 405: nothing is read or probed without a key
            body = self._read_body()
            if endpoint == "unmatched":
                raise ApiError(404, f"no endpoint {path}: see docs/server.md (OpenAI base URL: http://HOST:PORT/v1)",
                               code="not_found")
            if method not in methods:
                raise ApiError(405, f"{method} is not allowed on {endpoint}: use {', '.join(methods)}",
                               code="method_not_allowed", headers={"Allow": ", ".join(methods)})
            getattr(self, "_" + methods[method])(body, **params)
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            error = api_error(e)
            if error.status >= 500:
                log.error("%s %s failed", method, self.path, exc_info=not isinstance(e, (ApiError, TqstoreError)))
            try:
                if self._body_left:
                    self._drop_unread_body()
                self._send_error(error)
            except OSError:
                self.close_connection = True
        finally:
            # 499: the client went away before a status was sent (nginx's convention).
            self.app.metrics.request(endpoint, method, self._status or 499)

    def _check_host(self) -> None:
        """403 unless Host names this server and a browser's Origin (if any) is this server:
        a web page (cross-origin, or DNS-rebound to 127.0.0.1) cannot drive it."""
        allowed = self.app.allowed_hosts
        host = self.headers.get("Host")
        if allowed is not None and host is not None and _hostname(host) not in allowed:
            raise ApiError(403, f"the Host header {host[:80]!r} does not name this server: use one of "
                                f"{', '.join(sorted(allowed))} (or start it with --allowed-host NAME)",
                           code="forbidden_host")
        # A browser sends Origin on cross-origin requests (and same-origin POSTs): it must be
        # the origin the page reached this server by, the one in Host.
        origin = self.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc.lower() != (host or "").strip().lower():
            raise ApiError(403, f"cross-origin request from {origin[:80]!r} refused: browsers may only call this "
                                "server from its own origin", code="forbidden_origin")

    def _drop_unread_body(self) -> None:
        """Before an error sent without reading the body: drop a small one, close on a large one."""
        self._body_left = False
        self.close_connection = True
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < length <= UNREAD_DISCARD_LIMIT and not self.headers.get("Transfer-Encoding"):
            self.rfile.read(length)

    # -- request parts ---------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        self._body_left = False  # from here on, _read_body's own errors deal with the body
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "chunked request bodies are not supported: send a Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {raw!r}") from None
        if length > self.app.max_body_bytes:
            self._discard(length)
            raise ApiError(413, f"the request body has {length} bytes, more than the server's limit of "
                                f"{self.app.max_body_bytes} (--max-body-bytes)", code="body_too_large")
        try:
            body = self.rfile.read(length)
        except OSError:  # a reset or a stalled upload (the handler's timeout)
            raise ClientGone() from None
        if len(body) < length:
            raise ClientGone()
        return body

    def _discard(self, length: int) -> None:
        """Read and drop a refused body, so the client reads the error instead of a reset (closing
        a socket with unread data resets it); past DISCARD_LIMIT, just close."""
        self.close_connection = True
        left = length if length <= DISCARD_LIMIT else 0
        while left > 0:
            got = self.rfile.read(min(left, 1 << 16))
            if not got:
                break
            left -= len(got)

    def _authorize(self) -> None:
        key = self.app.api_key
        if key is None:
            return
        kind, _, token = self.headers.get("Authorization", "").partition(" ")
        if kind.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @staticmethod
    def _json(body: bytes, required: bool = True) -> Any:
        if not body.strip():
            if required:
                raise ApiError(400, "the request body is empty: send a JSON object")
            return None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body nests JSON too deeply") from None

    # -- responses --------------------------------------------------------------------------------

    def _send(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self._status = status

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_error(self, error: ApiError) -> None:
        if error.status == 503 and "Retry-After" not in error.headers:
            error.headers["Retry-After"] = "1"
        self._send_json(error.status, error.body(), error.headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, an unknown method), as JSON."""
        self.close_connection = True
        self._send_error(ApiError(code, message or self.responses.get(code, ("error",))[0]))

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _submit(self, submit) -> JobWatch:
        try:
            job: Job = submit()
        except QueueFull as e:
            self.app.metrics.count_rejected()
            raise ApiError(503, f"{e} (--max-queue {self.app.worker.capacity} requests are waiting already)",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        return JobWatch(job, self.connection)

    # -- OpenAI endpoints ---------------------------------------------------------------------------

    def _completions(self, body: bytes) -> None:
        self._generate(body, chat=False)

    def _chat_completions(self, body: bytes) -> None:
        self._generate(body, chat=True)

    def _generate(self, body: bytes, chat: bool) -> None:
        request = parse_generation(self._json(body), chat=chat, defaults=self.app.defaults)
        check_model(request.model, self.app.model_names)
        watch = self._submit(lambda: self.app.worker.generate(request))
        ids = ResponseIds(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                          self.app.model_id, chat)
        if not request.stream:
            gen = watch.result()
            self._send_json(200, completion_response(ids, gen),
                            {"X-TQStore-Tier": gen.tier, "X-TQStore-Cached-Tokens": str(gen.cached_tokens)})
            return
        first = watch.next_event()  # Accepted, or Failed while the status can still say so
        if isinstance(first, Failed):
            raise first.error
        chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-TQStore-Tier", first.tier)
        self.send_header("X-TQStore-Cached-Tokens", str(first.cached_tokens))
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self._status = 200
        try:
            self._stream(watch, EventStream(self.wfile, chunked), ids, request.include_usage)
        except OSError:
            watch.gone()

    @staticmethod
    def _stream(watch: JobWatch, stream: EventStream, ids: ResponseIds, include_usage: bool) -> None:
        if ids.chat:
            stream.send(chunk(ids, role=True))
        while True:
            event = watch.next_event()
            if isinstance(event, Text):
                stream.send(chunk(ids, event.text))
            elif isinstance(event, Finished):
                gen = event.value
                stream.send({**chunk(ids, finish_reason=gen.finish_reason), "tqstore": store_details(gen)})
                if include_usage:
                    stream.send(usage_chunk(ids, gen))
                break
            elif isinstance(event, Failed):  # after the 200: the error goes in the stream
                stream.send(event.error.body())
                break
        stream.close()

    def _models(self, body: bytes) -> None:
        self._send_json(200, {"object": "list", "data": [self._model_object()]})

    def _model(self, body: bytes, model: str) -> None:
        check_model(unquote(model), self.app.model_names)
        self._send_json(200, self._model_object())

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.app.model_id, "object": "model", "created": self.app.started, "owned_by": "tqstore"}

    # -- cache admin ----------------------------------------------------------------------------------

    def _list_caches(self, body: bytes) -> None:
        self._send_json(200, {"object": "list", "data": [_entry(i) for i in self.app.store.ls()]})

    def _get_cache(self, body: bytes, name: str) -> None:
        self._send_json(200, _entry(self.app.store.info(_name(name))))

    def _put_cache(self, body: bytes, name: str) -> None:
        name = _name(name)
        source = parse_cache_source(self._json(body))
        watch = self._submit(lambda: self.app.worker.save(name, source))
        self._send_json(200, _entry(watch.result()))

    def _delete_cache(self, body: bytes, name: str) -> None:
        name = _name(name)
        self.app.store.rm(name)
        self._send_json(200, {"id": name, "object": "cache", "deleted": True})

    def _pin(self, body: bytes, name: str) -> None:
        self._set_pinned(_name(name), parse_pin(self._json(body, required=False)))

    def _unpin(self, body: bytes, name: str) -> None:
        self._set_pinned(_name(name), False)

    def _set_pinned(self, name: str, pinned: bool) -> None:
        store = self.app.store
        store.pin(name) if pinned else store.unpin(name)
        self._send_json(200, _entry(store.info(name)))

    # -- operations -----------------------------------------------------------------------------------

    def _healthz(self, body: bytes) -> None:
        worker = self.app.worker
        if worker.ready.is_set():
            self._send_json(200, {"status": "ok", "model": self.app.model_id})
        else:
            status = "failed" if worker.load_error is not None else "loading"
            self._send_json(503, {"status": status, "model": self.app.model_id}, {"Retry-After": "1"})

    def _metrics(self, body: bytes) -> None:
        text = self.app.metrics.render(self.app.store.stats(), self.app.worker.queue_state())
        self._send(200, text.encode(), METRICS_TYPE)


def _match(path: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(route template, method -> handler name, path parameters); ("unmatched", {}, {}) if none."""
    for pattern, template, methods in ROUTES:
        match = pattern.fullmatch(path)
        if match is not None:
            return template, methods, match.groupdict()
    return "unmatched", {}, {}


def _hostname(host: str) -> str:
    """The name in a Host header: without the port, IPv6 without its brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _name(raw: str) -> str:
    # Decoded before validation, so %2F or %2E%2E are refused like '/' and '..'.
    return validate_name(unquote(raw))


def _entry(info) -> dict[str, Any]:
    return {"object": "cache", **dataclasses.asdict(info)}


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold up shutdown
    request_queue_size = 64  # the listen backlog: bursts of clients connect at once

    def __init__(self, address: tuple[str, int], app: App):
        self.app = app
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
