"""The OpenAI-compatible boundary of `tqstore serve`: typed requests parsed and validated from
JSON bodies, OpenAI-shaped responses, stream chunks and errors, and stop sequences.

Nothing here touches MLX, the store or the network: the HTTP layer (server.py) parses bodies
into these dataclasses, the model worker (serving.py) turns them into a `Generation`, and the
builders below turn that into what OpenAI clients expect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tqstore.errors import (BadInput, ConflictError, DiskFull, IdentityMismatch, InvalidName, NotFound,
                     RemoteNotConfigured, RemoteError, TqstoreError)

MAX_STOPS = 4  # as OpenAI


class ApiError(Exception):
    """An error the client gets as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# TqstoreError types in order (subclasses before their bases): status, OpenAI type, code.
_STATUSES: tuple[tuple[type[TqstoreError], int, str, str], ...] = (
    (InvalidName, 400, "invalid_request_error", "invalid_name"),
    (BadInput, 400, "invalid_request_error", "invalid_value"),
    (RemoteNotConfigured, 400, "invalid_request_error", "s3_not_configured"),
    (NotFound, 404, "invalid_request_error", "not_found"),
    (IdentityMismatch, 409, "invalid_request_error", "identity_mismatch"),
    (ConflictError, 409, "invalid_request_error", "conflict"),
    (DiskFull, 507, "server_error", "disk_full"),
    (RemoteError, 502, "server_error", "s3_error"),
)


def api_error(exc: BaseException) -> ApiError:
    """The client-facing error for an exception from the engine or the store. Anything that is
    not an ApiError or a TqstoreError is a bug: a 500 naming the exception type only."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, TqstoreError):
        for kind, status, type_, code in _STATUSES:
            if isinstance(exc, kind):
                return ApiError(status, str(exc), type=type_, code=code)
        return ApiError(500, str(exc), type="server_error", code=type(exc).__name__)
    return ApiError(500, f"internal error ({type(exc).__name__}): see the server log", type="server_error",
                    code="internal_error")


# --- requests ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """How to generate: length, randomness and where to stop."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


@dataclass(frozen=True)
class GenerationRequest:
    """One /v1/completions (prompt) or /v1/chat/completions (messages) request."""

    chat: bool
    model: str | None
    sampling: Sampling
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None  # contents flattened to strings
    tools: tuple[Any, ...] | None = None  # passed to the chat template, as mlx-lm does
    documents: tuple[tuple[str, str], ...] | None = None  # extension: ("text" | "name", value) in prompt order
    recompute: float | None = None  # extension: share of document tokens recomputed (None: the default)


@dataclass(frozen=True)
class CacheSource:
    """The body of PUT /v1/caches/{name}: exactly one of prompt, messages or document."""

    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    document: str | None = None
    system: str | None = None
    pinned: bool = False
    ttl: float | None = None


_MISSING = object()
MAX_DOCUMENTS = 64
_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}


def _get(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    # bool is an int in Python; JSON true is never a number here.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        names = " or ".join(_JSON_TYPES[k] for k in _tuple(kinds))
        raise ApiError(400, f"'{name}' must be {names}, not {type(value).__name__}: {str(value)[:40]!r}", param=name)
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _sampling(body: Mapping[str, Any], defaults: Sampling, chat: bool) -> Sampling:
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, limit_name, int, defaults.max_tokens)
    if max_tokens < 1:
        raise ApiError(400, f"'{limit_name}' must be at least 1, not {max_tokens}", param=limit_name)
    temperature = float(_get(body, "temperature", (int, float), defaults.temperature))
    if not 0.0 <= temperature <= 2.0 or math.isnan(temperature):
        raise ApiError(400, f"'temperature' must be from 0 to 2, not {temperature}", param="temperature")
    top_p = float(_get(body, "top_p", (int, float), defaults.top_p))
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], not {top_p}", param="top_p")
    seed = _get(body, "seed", int)
    stop = _get(body, "stop", (str, list), ())
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them",
                       param="stop")
    return Sampling(max_tokens, temperature, top_p, seed, stops)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), not {n!r}", param="n")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "logprobs are not supported by this server: leave 'logprobs' out", param="logprobs")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server: leave it out", param="echo")


def _prompt(body: Mapping[str, Any], name: str = "prompt") -> str | tuple[int, ...]:
    prompt = body.get(name)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return tuple(prompt)
    raise ApiError(400, f"'{name}' must be a string or an array of token ids (one prompt per request)", param=name)


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose 'role' is one of {', '.join(ROLES)}",
                           param="messages")
        if "content" not in message and message["role"] != "assistant":  # assistants may carry tool calls only
            raise ApiError(400, f"messages[{i}] has no 'content'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only, joined as mlx-lm does
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                           param="messages")
        out.append({**message, "content": content})
    return tuple(out)


def _documents(body: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The `documents` extension: texts, or {"name": stored chunk} / {"text": ...} objects."""
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs or len(docs) > MAX_DOCUMENTS:
        raise ApiError(400, f"'documents' must be a non-empty array of at most {MAX_DOCUMENTS} texts or "
                            "{\"name\": stored chunk} objects", param="documents")
    out = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            doc = {"text": doc}
        if not isinstance(doc, dict) or len(doc) != 1 or not isinstance(next(iter(doc.values())), str) \
                or next(iter(doc)) not in ("text", "name"):
            raise ApiError(400, f"documents[{i}] must be a string, {{\"text\": ...}} or {{\"name\": ...}}",
                           param="documents")
        out.append(next(iter(doc.items())))
    return tuple(out)


def parse_generation(body: Any, *, chat: bool, defaults: Sampling) -> GenerationRequest:
    """Validate a completions (chat=False) or chat completions body; ApiError(400) names the field.
    `defaults` gives max_tokens, temperature and top_p where the body leaves them out."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    _refuse_unsupported(body)
    stream = bool(_get(body, "stream", bool, False))
    options = _get(body, "stream_options", dict, {})
    tools = _get(body, "tools", list) if chat else None
    common = dict(chat=chat, model=_get(body, "model", str), sampling=_sampling(body, defaults, chat),
                  stream=stream, include_usage=stream and bool(options.get("include_usage")))
    if "documents" in body:
        common.update(documents=_documents(body), recompute=_get(body, "recompute", (int, float)))
        if common["recompute"] is not None and not 0 <= common["recompute"] <= 1:
            raise ApiError(400, "'recompute' is a fraction of the document tokens from 0 to 1", param="recompute")
    if chat:
        return GenerationRequest(**common, messages=_messages(body), tools=tuple(tools) if tools else None)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    return GenerationRequest(**common, prompt=_prompt(body))


def parse_cache_source(body: Any) -> CacheSource:
    """Validate a PUT /v1/caches/{name} body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object with one of 'prompt', 'messages' or 'document'")
    given = [k for k in ("prompt", "messages", "document") if body.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of 'prompt', 'messages' or 'document' (with an optional 'system'), "
                            f"not {given or 'none'}")
    ttl = _get(body, "ttl", (int, float))
    if ttl is not None and not ttl > 0:
        raise ApiError(400, f"'ttl' must be a positive number of seconds, not {ttl}", param="ttl")
    pinned = _get(body, "pinned", bool, False)
    kind = given[0]
    if kind != "document" and body.get("system") is not None:
        raise ApiError(400, "'system' goes with 'document' only (put a system message in 'messages')", param="system")
    if kind == "prompt":
        return CacheSource(prompt=_prompt(body), pinned=pinned, ttl=ttl)
    if kind == "messages":
        return CacheSource(messages=_messages(body), pinned=pinned, ttl=ttl)
    return CacheSource(document=_get(body, "document", str), system=_get(body, "system", str), pinned=pinned, ttl=ttl)


def parse_pin(body: Any) -> bool:
    """The body of POST /v1/caches/{name}/pin: empty (pin) or {"pinned": bool}."""
    if body is None:
        return True
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be empty or a JSON object like {\"pinned\": false}")
    return _get(body, "pinned", bool, True)


def check_model(requested: str | None, names: tuple[str, ...]) -> None:
    """Accept the served model under any of its `names`, as "default", or unnamed; else 404."""
    if not requested or requested == "default" or requested in names:
        return
    raise ApiError(404, f"the model {requested!r} is not served here: use {names[0]!r}, 'default' or leave "
                        "'model' out (GET /v1/models lists it)", param="model", code="model_not_found")


# --- stop sequences ------------------------------------------------------------------------------

class StopScanner:
    """Finds stop sequences in growing text and says what is safe to send so far: text that may
    be the start of a stop sequence is held back until the next tokens decide."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = 0
        self.end: int | None = None  # where the first stop sequence starts, once found

    def feed(self, text: str) -> str:
        """New text safe to send, given all the text so far; sets `end` on a stop sequence."""
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if hits:
            self.end = min(hits)
            return self._take(text, self.end)
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(text, len(text) - hold)

    def flush(self, text: str) -> str:
        """The rest of the text once generation ended without a stop sequence."""
        return self._take(text, len(text) if self.end is None else self.end)

    def final(self, text: str) -> str:
        """The whole answer: `text` cut before the stop sequence, if one was found."""
        return text if self.end is None else text[:self.end]

    def _take(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent:upto], upto
        return out


# --- responses -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """A finished generation and where its prompt came from."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from the store
    tier: str  # the slowest tier the restore read from: memory, lmdb, s3, or none
    restore_seconds: float
    prefill_seconds: float
    generation_seconds: float
    reused_tokens: int | None = None  # composed documents: tokens whose stored K/V were reused
    recomputed_tokens: int | None = None  # composed documents: tokens recomputed in context


@dataclass(frozen=True)
class ResponseIds:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def usage(gen: Generation) -> dict[str, Any]:
    """OpenAI usage, with the prompt tokens restored from the store as cached_tokens."""
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens, **_composed(gen)}}


def _composed(gen: Generation) -> dict[str, int]:
    if gen.reused_tokens is None:
        return {}
    return {"reused_tokens": gen.reused_tokens, "recomputed_tokens": gen.recomputed_tokens}


def store_details(gen: Generation) -> dict[str, Any]:
    """tqstore's own figures (an extra field OpenAI clients ignore)."""
    return {"tier": gen.tier, "cached_tokens": gen.cached_tokens, "restore_seconds": round(gen.restore_seconds, 6),
            "prefill_seconds": round(gen.prefill_seconds, 6), "generation_seconds": round(gen.generation_seconds, 6),
            **_composed(gen)}


def completion_response(ids: ResponseIds, gen: Generation) -> dict[str, Any]:
    """The whole (non-streamed) response."""
    if ids.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                  "finish_reason": gen.finish_reason}
    else:
        choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
    return {"id": ids.id, "object": ids.object, "created": ids.created, "model": ids.model, "choices": [choice],
            "usage": usage(gen), "tqstore": store_details(gen)}


def chunk(ids: ResponseIds, text: str | None = None, finish_reason: str | None = None,
          role: bool = False) -> dict[str, Any]:
    """One stream chunk: text, the first chat chunk (role), or the last (finish_reason)."""
    if ids.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model, "choices": [choice]}


def usage_chunk(ids: ResponseIds, gen: Generation) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {**chunk(ids), "choices": [], "usage": usage(gen), "tqstore": store_details(gen)}
