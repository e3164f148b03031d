"""The OpenAI-compatible boundary of `tqstore serve`: typed requests parsed and validated from
JSON bodies, OpenAI-shaped responses, stream chunks and errors, and stop sequences.

Request bodies are pydantic models; a body that does not fit is an ApiError(400) whose
`param` names the first bad field. Nothing here touches MLX, the store or the network: the
HTTP layer (http.py) parses bodies into the request dataclasses, the model worker (worker.py)
turns them into a `Generation`, and the builders below turn that into what OpenAI clients
expect.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tqstore.errors import (BadInput, ConflictError, DiskFull, IdentityMismatch, InvalidName, NotFound,
                     OverMemoryBudget, RemoteNotConfigured, RemoteError, TqstoreError)

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
    (OverMemoryBudget, 400, "invalid_request_error", "over_memory_budget"),
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
    api: str = "openai"  # which API asked (metrics): openai or anthropic


@dataclass(frozen=True)
class CacheSource:
    """The body of PUT /v1/caches/{name}: exactly one of prompt, messages or document."""

    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    document: str | None = None
    system: str | None = None
    pinned: bool = False
    ttl: float | None = None


# What bounds a request's documents is the memory their composition needs (store.compose_budget,
# checked before any work); this count only bounds the per-document lookups of one request.
MAX_DOCUMENTS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")

# The request bodies as pydantic models. Strict: JSON types are never coerced (true is not 1,
# "5" is not 5); null is the same as leaving a field out; fields OpenAI has and this server
# ignores are ignored.
_Strict = ConfigDict(strict=True, extra="ignore")
PositiveInt = Annotated[int, Field(ge=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# A prompt: a string, token ids, or a one-string array (what some clients send).
Prompt = str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)]
# Hints for fields whose pydantic message would not help (one line per union member), and for
# what this server refuses.
_HINTS = {"prompt": "a string or an array of token ids (one prompt per request)",
          "stop": f"a non-empty string or a list of at most {MAX_STOPS} of them",
          "documents": f"a non-empty array of at most {MAX_DOCUMENTS} texts, {{\"text\": ...}} or {{\"name\": "
                       "stored chunk} objects",
          "n": "1 (one choice per request)",
          "logprobs": "left out: logprobs are not supported by this server",
          "top_logprobs": "left out: logprobs are not supported by this server",
          "echo": "left out: it is not supported by this server",
          "seed": "an integer from 0 to 2**64 - 1"}
_MESSAGES_HINT = "a non-empty array of {role, content} objects"
_UNION_TAGS = {"str", "int", "float", "bool"}  # what pydantic puts in an error's path for a union member


def _prompt(prompt: str | list) -> str | tuple[int, ...]:
    return prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt[0], str) else tuple(prompt)


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    """A chat message; its other fields (name, tool_calls, ...) go to the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal[ROLES]
    content: str | list[_TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if not isinstance(content, (str, list, type(None))):
            raise PydanticCustomError("content_type", "must be a string or an array of text parts")
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise PydanticCustomError("text_only", "only text parts are supported")
        return content

    @model_validator(mode="before")
    @classmethod
    def _arguments_as_objects(cls, message: Any) -> Any:
        """A tool call's `arguments` as the object its JSON string holds: chat templates render
        them with `tojson` (a string would come out encoded twice), and the Anthropic route
        passes objects, so both routes give the model the same prompt (mlx-lm's server does the same)."""
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            return message
        parsed = []
        for i, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str) and function["arguments"]:
                try:
                    arguments = json.loads(function["arguments"])
                except ValueError:
                    raise PydanticCustomError("tool_arguments", "tool_calls[{i}].function.arguments is not JSON",
                                              {"i": i}) from None
                call = {**call, "function": {**function, "arguments": arguments}}
            parsed.append(call)
        return {**message, "tool_calls": parsed}

    @model_validator(mode="after")
    def _has_content(self) -> _Message:
        if "content" not in self.model_fields_set and self.role != "assistant":  # assistants may carry tool calls only
            raise PydanticCustomError("no_content", "the message has no 'content'")
        return self

    def flat(self) -> dict[str, Any]:
        """The message with its content as one string (text parts joined, as mlx-lm does)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {**self.model_dump(), "content": content or ""}


Messages = Annotated[list[_Message], Field(min_length=1)]


# A document: its text, {"text": ...} or {"name": stored chunk}.
Document = str | Annotated[dict[Literal["text", "name"], str], Field(min_length=1, max_length=1)]


class _StreamOptions(BaseModel):
    model_config = _Strict
    include_usage: bool | None = None


class _GenerationBody(BaseModel):
    model_config = _Strict
    model: str | None = None
    prompt: Prompt | None = None
    messages: Messages | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=(1 << 64) - 1)] | None = None  # MLX seeds are unsigned 64-bit
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)] | None) = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    tools: list[Any] | None = None
    # Asking for what this server does not do is refused, not ignored.
    n: Literal[1] | None = None
    logprobs: Literal[False, 0] | None = None
    top_logprobs: Literal[0] | None = None
    echo: Literal[False] | None = None
    # tqstore's extension: compose the context from stored chunks.
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)] | None = None
    recompute: Annotated[float, Field(ge=0, le=1)] | None = None


class _CacheBody(BaseModel):
    model_config = _Strict
    prompt: Prompt | None = None
    messages: Messages | None = None
    document: str | None = None
    system: str | None = None
    pinned: bool | None = None
    ttl: Annotated[float, Field(gt=0)] | None = None


class _PinBody(BaseModel):
    model_config = _Strict
    pinned: bool | None = None


def validate_body(model: type[BaseModel], body: Any, what: str) -> Any:
    """`body` as `model`; ApiError(400) naming the first bad field (`param`) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object{what}, not {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # The deepest of the first field's errors: for `str | list[block]` the first is the string
        # branch's ("must be a valid string"), where an image block's real fault is its type.
        error = max((err for err in errors if err["loc"][:1] == errors[0]["loc"][:1]), key=lambda err: len(err["loc"]))
        param = str(error["loc"][0]) if error["loc"] else None
        raise ApiError(400, _message(error, param), param=param, code="invalid_value") from None


def _message(error: Mapping[str, Any], param: str | None) -> str:
    loc = error["loc"]
    if param is None:
        return error["msg"]
    if param in _HINTS:
        return f"'{param}' must be {_HINTS[param]}"
    if param == "messages" and len(loc) == 1:
        return f"'messages' must be {_MESSAGES_HINT}"
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                            if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS))
    if error["type"] == "greater_than_equal":
        return f"'{where}' must be at least {error['ctx']['ge']}, not {error['input']!r}"
    text = error["msg"].replace("Input should be", "must be")
    if isinstance(error["input"], (dict, list)):
        return f"'{where}' {text}" if text.startswith("must") else f"'{where}': {text}"
    return f"'{where}' {text}, not {error['input']!r:.40}" if text.startswith("must") else f"'{where}': {text}"


def parse_generation(body: Any, *, chat: bool, defaults: Sampling) -> GenerationRequest:
    """Validate a completions (chat=False) or chat completions body; ApiError(400) names the field.
    `defaults` gives max_tokens, temperature and top_p where the body leaves them out."""
    b: _GenerationBody = validate_body(_GenerationBody, body, "")
    if chat and b.messages is None:
        raise ApiError(400, f"'messages' must be {_MESSAGES_HINT}", param="messages")
    if not chat and b.prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    max_tokens = b.max_completion_tokens if chat and b.max_completion_tokens is not None else b.max_tokens
    stop = b.stop or ()
    sampling = Sampling(max_tokens or defaults.max_tokens,
                        defaults.temperature if b.temperature is None else b.temperature,
                        defaults.top_p if b.top_p is None else b.top_p, b.seed,
                        (stop,) if isinstance(stop, str) else tuple(stop))
    stream = bool(b.stream)
    documents = None if b.documents is None else tuple(
        ("text", d) if isinstance(d, str) else next(iter(d.items())) for d in b.documents)
    return GenerationRequest(chat=chat, model=b.model, sampling=sampling, stream=stream,
                             include_usage=stream and bool(b.stream_options and b.stream_options.include_usage),
                             prompt=None if chat else _prompt(b.prompt),
                             messages=tuple(m.flat() for m in b.messages) if chat else None,
                             tools=tuple(b.tools) if chat and b.tools else None,
                             documents=documents, recompute=None if documents is None else b.recompute)


def parse_cache_source(body: Any) -> CacheSource:
    """Validate a PUT /v1/caches/{name} body."""
    b: _CacheBody = validate_body(_CacheBody, body, " with one of 'prompt', 'messages' or 'document'")
    given = [k for k in ("prompt", "messages", "document") if getattr(b, k) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of 'prompt', 'messages' or 'document' (with an optional 'system'), "
                            f"not {given or 'none'}")
    if given != ["document"] and b.system is not None:
        raise ApiError(400, "'system' goes with 'document' only (put a system message in 'messages')", param="system")
    return CacheSource(prompt=None if b.prompt is None else _prompt(b.prompt),
                       messages=None if b.messages is None else tuple(m.flat() for m in b.messages),
                       document=b.document, system=b.system, pinned=bool(b.pinned), ttl=b.ttl)


def parse_pin(body: Any) -> bool:
    """The body of POST /v1/caches/{name}/pin: empty (pin) or {"pinned": bool}."""
    if body is None:
        return True
    pinned = validate_body(_PinBody, body, " like {\"pinned\": false}, or empty").pinned
    return True if pinned is None else pinned


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
        self.matched: str | None = None  # the stop sequence found there

    def feed(self, text: str) -> str:
        """New text safe to send, given all the text so far; sets `end` on a stop sequence."""
        hits = [(i, s) for i, s in ((text.find(s, max(0, self.sent - len(s))), s) for s in self.stops) if i >= 0]
        if hits:
            self.end, self.matched = min(hits)
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
    stop_sequence: str | None = None  # the stop sequence that ended it, if one did


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
