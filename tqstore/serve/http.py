"""The HTTP layer of the OpenAI- and Anthropic-compatible server, an ASGI application that
uvicorn runs (main.py); docs/server.md describes the APIs.

Starlette routes requests and writes responses and streams. `Guard`, the application's entry
point, does what comes before routing for every request: the Host and Origin checks, the API
key, the body (its size limit and a stall timeout), the error shape (Anthropic's on
/v1/messages paths), and the request metrics. The work lives elsewhere: openai_schema.py and
anthropic_schema.py validate requests and shape responses, worker.py
runs every model job on one owner thread behind a bounded queue, streams.py brings a job's
events to the event loop, metrics.py counts. Handlers never touch MLX: store catalog calls
(list, info, remove, pin) run on worker threads of the loop (anyio), never on the loop itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from anyio import to_thread
from starlette.datastructures import Headers
from starlette.endpoints import HTTPEndpoint
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match, Route, Router
from starlette.types import Receive, Scope, Send

from tqstore.errors import NotFound, TqstoreError
from tqstore.names import validate_name
from tqstore.serve import anthropic_schema as anthropic
from tqstore.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from tqstore.serve.metrics import Metrics
from tqstore.serve.options import LOOPBACK_NAMES
from tqstore.serve.openai_schema import (ApiError, ResponseIds, Sampling, StopScanner, api_error, check_model,
                                         chunk, completion_response, parse_cache_source, parse_generation, parse_pin,
                                         store_details, usage_chunk)
from tqstore.serve.streams import DONE, ClientGone, JobEvents, sse
from tqstore.serve.jobs import Accepted, Failed, Finished, QueueFull, Text
from tqstore.serve.worker import ModelWorker

log = logging.getLogger("tqstore.serve")
# The largest request head. h11 refuses an unfinished head past this (400), but a whole head that
# came in one read (up to 256 KiB) would pass it: Guard checks the size of what arrived.
MAX_HEAD_BYTES = 64 << 10
# The slowest a body may arrive on average, past its first --keep-alive seconds: a client that
# trickles a byte now and then never stalls, and would otherwise hold its connection for as long
# as its Content-Length lasts.
MIN_BODY_BYTES_PER_SECOND = 64 << 10
# Set in the ASGI scope once a request passed the API key check (always, without a key): the
# connection eviction in main.py closes idle connections without one first.
AUTHORIZED = "tqstore.authorized"
ANTHROPIC_PATHS = "/v1/messages"  # paths under it answer errors in Anthropic's shape


@dataclass
class App:
    """What every request handler shares (`request.app`)."""

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
    stall_seconds: float = 30.0  # --keep-alive: a body that sends nothing for this long gets 408

    @property
    def store(self):
        return self.worker.engine.store


class Guard:
    """The ASGI application: checks, reads and counts every request, then hands it to the
    router; any exception becomes an OpenAI-shaped error response."""

    def __init__(self, app: App):
        self.app = app
        self.router = Router(ROUTES, redirect_slashes=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan off; websockets are not served
            return
        status = 0

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        method, endpoint = scope["method"], self._template(scope)
        # Starlette raises HTTPException for 404 and 405 when the scope names an app; handlers
        # read the shared state as request.app.
        scope["app"] = self.app
        try:
            if sum(len(name) + len(value) for name, value in scope["headers"]) > MAX_HEAD_BYTES:
                raise ApiError(431, f"the request headers are larger than {MAX_HEAD_BYTES >> 10} KiB",
                               code="headers_too_large")
            headers = Headers(scope=scope)
            self._check_host(headers)  # before anything: a DNS-rebound or cross-site page gets nothing
            if scope["path"] != "/healthz":
                self._authorize(headers)  # before the body, 404 and 405: nothing is read or probed without a key
                scope[AUTHORIZED] = True
            body = await self._read_body(headers, receive)
            await self.router(scope, _replay(body, receive), counted)
        except ClientGone:
            pass
        except Exception as e:
            if status:  # the response started (a stream): nothing more can be sent
                if not isinstance(e, OSError):  # OSError: the client went away mid-write
                    log.error("%s %s failed after its response started", method, scope["path"], exc_info=True)
                return
            error = _routing_error(e, scope, endpoint) or api_error(e)
            if error.code == "shutting_down":  # every request a stop finds queued: expected, not a fault
                log.info("%s %s answered 503: the server is shutting down", method, scope["path"])
            elif error.status >= 500:
                log.error("%s %s failed", method, scope["path"],
                          exc_info=not isinstance(e, (ApiError, TqstoreError)))
            await error_response(error, scope["path"].startswith(ANTHROPIC_PATHS))(scope, receive, counted)
        finally:
            # 499: the client went away before a status was sent (nginx's convention).
            self.app.metrics.request(endpoint, method, status or 499)

    def _template(self, scope: Scope) -> str:
        """The route template a path matches (for the metrics), known before authorization."""
        for route in self.router.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return route.path
        return "unmatched"

    def _check_host(self, headers: Headers) -> None:
        """403 unless Host names this server and a browser's Origin (if any) is this server:
        a web page (cross-origin, or DNS-rebound to 127.0.0.1) cannot drive it."""
        allowed = self.app.allowed_hosts
        host = headers.get("host")
        if allowed is not None and host is not None and _hostname(host) not in allowed:
            raise ApiError(403, f"the Host header {host[:80]!r} does not name this server: use one of "
                                f"{', '.join(sorted(allowed))} (or start it with --allowed-host NAME)",
                           code="forbidden_host")
        # A browser sends Origin on cross-origin requests (and same-origin POSTs): it must be
        # the origin the page reached this server by, the one in Host.
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc.lower() != (host or "").strip().lower():
            raise ApiError(403, f"cross-origin request from {origin[:80]!r} refused: browsers may only call this "
                                "server from its own origin", code="forbidden_origin")

    def _authorize(self, headers: Headers) -> None:
        key = self.app.api_key
        if key is None:
            return
        kind, _, token = headers.get("authorization", "").partition(" ")
        if "x-api-key" in headers:  # Anthropic's clients send the key so
            kind, token = "bearer", headers["x-api-key"]
        if kind.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes:
        """The whole body, refused (413) from its Content-Length before any of it is read. A
        refused body is never read here: uvicorn drops what the client still sends after the
        response, until its keep-alive timeout closes the connection. A body that stalls for
        --keep-alive, or is not all there by its deadline (--keep-alive plus its length at
        MIN_BODY_BYTES_PER_SECOND), gets 408 and the connection is closed."""
        if "transfer-encoding" in headers:
            raise ApiError(411, "chunked request bodies are not supported: send a Content-Length")
        length = int(headers.get("content-length") or 0)  # h11 has checked that it is a number
        if length > self.app.max_body_bytes:
            raise ApiError(413, f"the request body has {length} bytes, more than the server's limit of "
                                f"{self.app.max_body_bytes} (--max-body-bytes)", code="body_too_large")
        body = bytearray()
        stall = self.app.stall_seconds
        allowed = stall + length / MIN_BODY_BYTES_PER_SECOND
        deadline = time.monotonic() + allowed
        while len(body) < length:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), min(stall, left))
            except TimeoutError:
                why = (f"stalled for {stall:g} s (--keep-alive)" if left > stall else
                       f"was not complete after {allowed:.0f} s (--keep-alive, plus "
                       f"{MIN_BODY_BYTES_PER_SECOND >> 10} KiB/s)")
                # Closed after the answer: the rest of the body would keep the connection busy.
                raise ApiError(408, f"the request body {why}: send it at once", code="timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body already read handed out first (then: the disconnect)."""
    first = {"type": "http.request", "body": body, "more_body": False}

    async def replay() -> dict:
        nonlocal first
        if first is not None:
            message, first = first, None
            return message
        return await receive()

    return replay


def _routing_error(exc: Exception, scope: Scope, endpoint: str) -> ApiError | None:
    """The router's 404 and 405, in the API's words."""
    if not isinstance(exc, HTTPException):
        return None
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return ApiError(405, f"{scope['method']} is not allowed on {endpoint}: use {allow}",
                        code="method_not_allowed", headers={"Allow": allow})
    return ApiError(404, f"no endpoint {scope['path']}: see docs/server.md (OpenAI base URL: http://HOST:PORT/v1)",
                    code="not_found")


def error_response(error: ApiError, anthropic_shape: bool = False) -> JSONResponse:
    """The JSON error response (OpenAI's shape, or Anthropic's); 503s say when to retry."""
    if error.status == 503:
        error.headers.setdefault("Retry-After", "1")
    body = anthropic.error_body(error) if anthropic_shape else error.body()
    return JSONResponse(body, error.status, error.headers)


def _json(body: bytes, required: bool = True) -> Any:
    """The body as strict JSON: no NaN or Infinity, no number too large for a float, and no
    string with a lone UTF-16 surrogate ("\\ud800": valid JSON, but no text; the tokenizer
    cannot encode it)."""
    if not body.strip():
        if required:
            raise ApiError(400, "the request body is empty: send a JSON object")
        return None
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply") from None
    _check_text(value)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any) -> None:
    """ApiError(400) naming the first string (key or value) with a lone surrogate. Walked with a
    stack, not recursion: json.loads accepts nesting deeper than a recursive walk could take."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                path = f"{where}.{key}" if where else str(key)
                if _SURROGATE.search(key):
                    raise _surrogate_error(where, "a key of ")
                stack.append((inner, path))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))
        elif isinstance(item, str) and _SURROGATE.search(item):
            raise _surrogate_error(where)


def _surrogate_error(where: str, what: str = "") -> ApiError:
    """`where`: the path of a field (its keys have no surrogate), '' for the body itself."""
    shown = f"{what}'{where[:80]}'" if where else f"{what}the body"
    return ApiError(400, f"{shown} has a lone UTF-16 surrogate (an escape like \\ud800 without its pair): send valid "
                         "Unicode text", param=where.partition(".")[0].partition("[")[0] or None)


async def _submit(request: Request, submit, texts: bool = False) -> JobEvents:
    """Queue a job (`submit(sink)`) whose events the handler then awaits (Text events only if
    `texts`: a stream)."""
    app: App = request.app
    events = JobEvents(request.receive, texts)
    try:
        events.job = submit(events.sink)
    except QueueFull as e:
        app.metrics.count_rejected()
        raise ApiError(503, f"{e} (--max-queue {app.worker.capacity} requests are waiting already)",
                       type="server_error", code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
    return events


async def _store_call(function, *args) -> Any:
    """A store catalog call, off the event loop (it may wait for LMDB or a lock). An entry not
    found is a 404 that names the entry only: the store's message names its folder, which is the
    server's business, not its clients'."""
    try:
        return await to_thread.run_sync(function, *args)
    except NotFound:
        if args and isinstance(args[0], str):
            raise ApiError(404, f"no entry {args[0]}: GET /v1/caches lists the entries", code="not_found") from None
        raise


# -- OpenAI endpoints -------------------------------------------------------------------------------

async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    app: App = request.app
    body = parse_generation(_json(await request.body()), chat=chat, defaults=app.defaults)
    check_model(body.model, app.model_names)
    events = await _submit(request, lambda sink: app.worker.generate(body, sink), texts=body.stream)
    ids = ResponseIds(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), app.model_id, chat)
    if not body.stream:
        gen = await events.result()
        return JSONResponse(completion_response(ids, gen),
                            headers={"X-TQStore-Tier": gen.tier, "X-TQStore-Cached-Tokens": str(gen.cached_tokens)})
    try:
        first = await events.next_event()  # Accepted, or Failed while the status can still say so
        if isinstance(first, Failed):
            raise first.error
    except BaseException:
        events.close()
        raise
    # The content type verbatim: Starlette would add a charset to a text/ media type.
    return StreamingResponse(_stream(events, ids, body.include_usage),
                             headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      "X-TQStore-Tier": first.tier,
                                      "X-TQStore-Cached-Tokens": str(first.cached_tokens)})


async def _stream(events: JobEvents, ids: ResponseIds, include_usage: bool):
    try:
        if ids.chat:
            yield sse(chunk(ids, role=True))
        while True:
            event = await events.next_event()
            if isinstance(event, Text):
                yield sse(chunk(ids, event.text))
            elif isinstance(event, Finished):
                gen = event.value
                yield sse({**chunk(ids, finish_reason=gen.finish_reason), "tqstore": store_details(gen)})
                if include_usage:
                    yield sse(usage_chunk(ids, gen))
                break
            elif isinstance(event, Failed):  # after the 200: the error goes in the stream
                yield sse(event.error.body())
                break
        yield DONE
    except Exception as e:  # a fault of ours after the 200: the client still reads an error, not a cut stream
        log.error("a completion's stream failed", exc_info=True)
        yield sse(api_error(e).body())
        yield DONE
    finally:  # also when the client left and Starlette cancelled the stream
        events.close()


# -- the Anthropic Messages API ---------------------------------------------------------------------

async def messages(request: Request) -> Response:
    app: App = request.app
    body = anthropic.parse_messages(_json(await request.body()), defaults=app.defaults)
    events = await _submit(request, lambda sink: app.worker.generate(body, sink), texts=body.stream)
    msg_id = anthropic.message_id()
    fmt = anthropic.ToolFormat.of(app.worker.loaded.tokenizer) if body.tools else None
    if not body.stream:
        gen = await events.result()
        return JSONResponse(anthropic.message_response(msg_id, app.model_id, gen, fmt, body.tools),
                            headers={"X-TQStore-Tier": gen.tier, "X-TQStore-Cached-Tokens": str(gen.cached_tokens)})
    try:
        first = await events.next_event()
        if isinstance(first, Failed):
            raise first.error
    except BaseException:
        events.close()
        raise
    return StreamingResponse(_message_stream(events, msg_id, app.model_id, first, fmt, body.tools),
                             headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      "X-TQStore-Tier": first.tier,
                                      "X-TQStore-Cached-Tokens": str(first.cached_tokens)})


async def _message_stream(events: JobEvents, msg_id: str, model_id: str, first: Accepted,
                          fmt: anthropic.ToolFormat | None, tools):
    """Anthropic's events: message_start, a text block streamed as it comes (text that may
    start a tool call held back), tool_use blocks once the answer is complete, message_delta
    with the stop reason and usage, message_stop; an error after the start as an error event."""
    held = StopScanner((fmt.start,)) if fmt is not None and tools else None
    use = {"input_tokens": first.prompt_tokens - first.cached_tokens, "output_tokens": 0,
           "cache_read_input_tokens": first.cached_tokens, "cache_creation_input_tokens": 0}
    blocks = 0  # content blocks opened so far; the text block, when there is one, is the first
    text, sent = "", 0

    def text_delta(new: str):
        nonlocal blocks
        if not blocks:
            blocks = 1
            yield anthropic.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield anthropic.event("ping")
        yield anthropic.event("content_block_delta", index=0, delta={"type": "text_delta", "text": new})

    try:
        yield anthropic.event("message_start", message=anthropic.message(msg_id, model_id, [], None, None, use))
        while True:
            event = await events.next_event()
            if isinstance(event, Text):
                text += event.text
                new = held.feed(text) if held is not None else event.text
                if new:
                    sent += len(new)
                    for part in text_delta(new):
                        yield part
            elif isinstance(event, Finished):
                gen = event.value
                visible, calls = fmt.split(gen.text, tools) if held is not None else (gen.text, [])
                if visible[sent:] or not (blocks or calls):
                    for part in text_delta(visible[sent:]):
                        yield part
                if blocks:
                    yield anthropic.event("content_block_stop", index=0)
                for index, call in enumerate(calls, start=blocks):
                    yield anthropic.event("content_block_start", index=index, content_block={**call, "input": {}})
                    yield anthropic.event("content_block_delta", index=index,
                                          delta={"type": "input_json_delta", "partial_json": json.dumps(call["input"])})
                    yield anthropic.event("content_block_stop", index=index)
                yield anthropic.event("message_delta",
                                      delta={"stop_reason": anthropic.stop_reason(gen, bool(calls)),
                                             "stop_sequence": anthropic.stop_sequence(gen, bool(calls))},
                                      usage={"output_tokens": gen.completion_tokens}, tqstore=store_details(gen))
                yield anthropic.event("message_stop")
                break
            elif isinstance(event, Failed):
                yield anthropic.event("error", error=anthropic.error_body(event.error)["error"])
                break
    except Exception as e:  # a fault of ours after message_start: an error event, not a cut stream
        log.error("a message's stream failed", exc_info=True)
        yield anthropic.event("error", error=anthropic.error_body(api_error(e))["error"])
    finally:
        events.close()


async def count_tokens(request: Request) -> Response:
    app: App = request.app
    body = anthropic.parse_count(_json(await request.body()), defaults=app.defaults)
    events = await _submit(request, lambda sink: app.worker.count(body, sink))
    return JSONResponse({"input_tokens": await events.result()})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_object(request.app)]})


async def model(request: Request) -> Response:
    check_model(request.path_params["model"], request.app.model_names)
    return JSONResponse(_model_object(request.app))


def _model_object(app: App) -> dict[str, Any]:
    return {"id": app.model_id, "object": "model", "created": app.started, "owned_by": "tqstore"}


# -- cache admin --------------------------------------------------------------------------------------

async def list_caches(request: Request) -> Response:
    infos = await _store_call(request.app.store.ls)
    return JSONResponse({"object": "list", "data": [_entry(i) for i in infos]})


class Cache(HTTPEndpoint):
    """/v1/caches/{name}: one entry."""

    async def get(self, request: Request) -> Response:
        return JSONResponse(_entry(await _store_call(request.app.store.info, _name(request))))

    async def put(self, request: Request) -> Response:
        app: App = request.app
        name = _name(request)
        source = parse_cache_source(_json(await request.body()))
        events = await _submit(request, lambda sink: app.worker.save(name, source, sink))
        return JSONResponse(_entry(await events.result()))

    async def delete(self, request: Request) -> Response:
        name = _name(request)
        await _store_call(request.app.store.rm, name)
        return JSONResponse({"id": name, "object": "cache", "deleted": True})


class Pin(HTTPEndpoint):
    """/v1/caches/{name}/pin: POST pins (or unpins with {"pinned": false}), DELETE unpins."""

    async def post(self, request: Request) -> Response:
        name = _name(request)
        return await _set_pinned(request.app, name, parse_pin(_json(await request.body(), required=False)))

    async def delete(self, request: Request) -> Response:
        return await _set_pinned(request.app, _name(request), False)


async def _set_pinned(app: App, name: str, pinned: bool) -> Response:
    await _store_call(app.store.pin if pinned else app.store.unpin, name)
    return JSONResponse(_entry(await _store_call(app.store.info, name)))


# -- operations -----------------------------------------------------------------------------------------

async def healthz(request: Request) -> Response:
    app: App = request.app
    if app.worker.ready.is_set():
        return JSONResponse({"status": "ok", "model": app.model_id})
    status = "failed" if app.worker.load_error is not None else "loading"
    return JSONResponse({"status": status, "model": app.model_id}, 503, {"Retry-After": "1"})


async def metrics(request: Request) -> Response:
    app: App = request.app
    stats = await _store_call(app.store.stats)
    return Response(app.metrics.render(stats, app.worker.queue_state()), media_type=METRICS_TYPE)


def _hostname(host: str) -> str:
    """The name in a Host header: without the port, IPv6 without its brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _name(request: Request) -> str:
    # uvicorn decodes the path before routing, so %2F or %2E%2E are refused like '/' and '..'.
    return validate_name(request.path_params["name"])


def _entry(info) -> dict[str, Any]:
    return {"object": "cache", **dataclasses.asdict(info)}


# The first match wins: the pin route before the entry route that would also match it.
ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/v1/caches", list_caches, methods=["GET"]),
    Route("/v1/caches/{name:path}/pin", Pin),
    Route("/v1/caches/{name:path}", Cache),
]
