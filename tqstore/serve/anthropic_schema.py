"""The Anthropic Messages API boundary of `tqstore serve`: `POST /v1/messages` and
`/v1/messages/count_tokens` bodies parsed into the server's GenerationRequest, and Anthropic's
responses, stream events and errors built from a Generation.

Messages become chat-template messages as mlx-lm's server renders OpenAI ones: `system` a
system message, text blocks joined, `tool_use` blocks an assistant message's `tool_calls`
(arguments as objects), `tool_result` blocks `tool` messages; `tools` go to the chat template in
OpenAI's function form. Tool calls are parsed back out of the answer with the tokenizer's tool
parser (mlx-lm infers it from the chat template) where it knows one. Nothing here touches MLX.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tqstore.serve.openai_schema import ApiError, Generation, GenerationRequest, Sampling, validate_body

log = logging.getLogger("tqstore.serve")
MAX_STOP_SEQUENCES = 64
# Anthropic's error types by HTTP status (others: invalid_request_error below 500, api_error above).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

_Strict = ConfigDict(strict=True, extra="ignore")


class _Text(BaseModel):
    model_config = _Strict
    type: Literal["text"]
    text: str


class _ToolUse(BaseModel):
    model_config = _Strict
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _ToolResult(BaseModel):
    model_config = _Strict
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[_Text] | None = None
    is_error: bool | None = None


class _Thinking(BaseModel):
    """Earlier thinking blocks: accepted and left out of the prompt."""

    model_config = _Strict
    type: Literal["thinking", "redacted_thinking"]


_Block = Annotated[_Text | _ToolUse | _ToolResult | _Thinking, Field(discriminator="type")]


class _Message(BaseModel):
    model_config = _Strict
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class _Tool(BaseModel):
    model_config = _Strict
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]


class _CountBody(BaseModel):
    model_config = _Strict
    model: str | None = None
    messages: Annotated[list[_Message], Field(min_length=1)]
    system: str | list[_Text] | None = None
    tools: list[_Tool] | None = None


class _MessagesBody(_CountBody):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: (Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)]
                     | None) = None
    temperature: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = None


def _text(content: str | list[_Text] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(system: str | list[_Text] | None, messages: list[_Message]) -> list[dict[str, Any]]:
    """Anthropic messages as chat-template messages (OpenAI's roles and tool-call fields)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(system)}] if system else []
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for block in message.content:
            if isinstance(block, _Text):
                texts.append(block.text)
            elif isinstance(block, _ToolUse):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, _ToolResult):
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
        if message.role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(tools: list[_Tool] | None) -> tuple[dict[str, Any], ...] | None:
    if not tools:
        return None
    return tuple({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in tools)


def parse_messages(body: Any, *, defaults: Sampling) -> GenerationRequest:
    """Validate a POST /v1/messages body; ApiError(400) names the first bad field. Any `model`
    is served by the one model (agents send their own model names)."""
    b: _MessagesBody = validate_body(_MessagesBody, body, "")
    sampling = Sampling(b.max_tokens, defaults.temperature if b.temperature is None else b.temperature,
                        defaults.top_p if b.top_p is None else b.top_p, None, tuple(b.stop_sequences or ()))
    return GenerationRequest(chat=True, model=None, sampling=sampling, stream=bool(b.stream), include_usage=False,
                             messages=tuple(chat_messages(b.system, b.messages)), tools=_tools(b.tools),
                             api="anthropic")


def parse_count(body: Any, *, defaults: Sampling) -> GenerationRequest:
    """Validate a POST /v1/messages/count_tokens body (a messages body without max_tokens)."""
    b: _CountBody = validate_body(_CountBody, body, "")
    return GenerationRequest(chat=True, model=None, sampling=defaults, stream=False, include_usage=False,
                             messages=tuple(chat_messages(b.system, b.messages)), tools=_tools(b.tools),
                             api="anthropic")


# --- tool calls in the answer ----------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    """How the model writes tool calls (mlx-lm's tokenizer knows it from the chat template)."""

    start: str
    end: str
    parser: Any  # mlx-lm's parse_tool_call(text, tools) -> {"name", "arguments"} or a list of them

    @classmethod
    def of(cls, tokenizer) -> ToolFormat | None:
        if not getattr(tokenizer, "has_tool_calling", False) or getattr(tokenizer, "tool_parser", None) is None:
            return None
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)

    def split(self, text: str, tools: tuple[dict[str, Any], ...] | None) -> tuple[str, list[dict[str, Any]]]:
        """(the text before the first tool call, tool_use blocks of the calls that parse)."""
        head, found, rest = text.partition(self.start)
        if not found:
            return text, []
        blocks = []
        for part in rest.split(self.start):
            call_text = part.partition(self.end)[0] if self.end else part
            try:
                parsed = self.parser(call_text, list(tools or ()))
            except Exception as e:  # parsers raise what their format's library raises
                log.info("a tool call did not parse (%s: %s); dropped", type(e).__name__, e)
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                block = _tool_use(call)
                if block is None:
                    log.info("a tool call parsed to %r, not a call with a name; dropped", call)
                    continue
                blocks.append(block)
        return head, blocks


def _tool_use(call: Any) -> dict[str, Any] | None:
    """The tool_use block of one parsed call, or None where the model wrote JSON that is no call
    (a bare string, number or list parses as JSON too)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {"arguments": arguments}
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["name"],
            "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


# --- responses -----------------------------------------------------------------------------------

def usage(gen: Generation) -> dict[str, int]:
    """Anthropic usage: input_tokens are the prompt tokens not restored from the store (as
    Anthropic counts tokens after a cache read), cache_read_input_tokens those restored."""
    return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(gen: Generation, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_use"
    if gen.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if gen.finish_reason == "length" else "end_turn"


def stop_sequence(gen: Generation, tool_calls: bool) -> str | None:
    """The stop sequence that ended the answer, only where it is the stop reason (Anthropic's
    rule: a tool_use stop names none, even if the model then wrote a stop sequence)."""
    return gen.stop_sequence if stop_reason(gen, tool_calls) == "stop_sequence" else None


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message(msg_id: str, model: str, content: list[dict[str, Any]], stop: str | None, stop_sequence: str | None,
            use: dict[str, int]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": use}


def message_response(msg_id: str, model: str, gen: Generation, fmt: ToolFormat | None,
                     tools: tuple[dict[str, Any], ...] | None) -> dict[str, Any]:
    """The whole (non-streamed) response."""
    text, calls = fmt.split(gen.text, tools) if fmt is not None and tools else (gen.text, [])
    content = ([{"type": "text", "text": text}] if text or not calls else []) + calls
    return {**message(msg_id, model, content, stop_reason(gen, bool(calls)), stop_sequence(gen, bool(calls)), usage(gen)),
            "tqstore": _store(gen)}


def _store(gen: Generation) -> dict[str, Any]:
    return {"tier": gen.tier, "cached_tokens": gen.cached_tokens, "restore_seconds": round(gen.restore_seconds, 6),
            "prefill_seconds": round(gen.prefill_seconds, 6), "generation_seconds": round(gen.generation_seconds, 6)}


def event(kind: str, **fields: Any) -> bytes:
    """One server-sent event as Anthropic sends them: `event: kind` and `data: {"type": kind, ...}`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
