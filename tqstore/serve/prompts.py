"""Requests' prompts as token ids, tokenized as mlx-lm's server tokenizes them, and the limits a
model's config sets on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqstore.errors import BadInput
from tqstore.models.loading import LoadedModel
from tqstore.models.prompting import encode_prompt
from tqstore.serve.openai_schema import GenerationRequest

UNKNOWN_CONTEXT_TOKENS = 32768  # the token cap of a model whose config names no context length
_CONTEXT_FIELDS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length", "n_ctx")
# mlx-lm's role prefixes for tokenizers without a chat template (its server's convert_chat).
_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}


def completion_tokens(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """A completions prompt: token ids as given; text with special tokens unless it already
    starts with the BOS token (as mlx-lm's generate)."""
    if not isinstance(prompt, str):
        return list(prompt)
    return encode_prompt(tokenizer, prompt)


def chat_tokens(tokenizer, messages: Sequence[dict], tools: Sequence[Any] | None = None) -> list[int]:
    """Chat messages through the tokenizer's chat template with the generation prompt, as
    mlx-lm's server; a tokenizer without a template gets mlx-lm's plain role prefixes."""
    if getattr(tokenizer, "has_chat_template", False):
        try:
            return list(tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                      add_generation_prompt=True, tokenize=True))
        except Exception as e:  # jinja raises TemplateError and plain exceptions alike
            raise BadInput(f"the model's chat template refused these messages: {e}") from None
    text = "".join(f"{_ROLES.get(m['role'], '')}{m['content']}\n" for m in messages) + _ROLES["assistant"]
    return list(tokenizer.encode(text.rstrip()))


def request_tokens(loaded: LoadedModel, prompt: str | Sequence[int] | None, messages: Sequence[dict] | None,
                   tools: Sequence[Any] | None = None) -> list[int]:
    """A request's prompt (chat `messages`, else a completions `prompt`) as token ids of
    `loaded`'s vocabulary; BadInput when it is empty or names an id outside the vocabulary."""
    if messages is not None:
        tokens = chat_tokens(loaded.tokenizer, messages, tools)
    else:
        tokens = completion_tokens(loaded.tokenizer, prompt)
    limit = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    if limit is not None and any(t >= limit for t in tokens):
        raise BadInput(f"token ids must be below the vocabulary size {limit}")
    if not tokens:
        raise BadInput("the prompt is empty: send at least one token")
    return tokens


def documents_question(request: GenerationRequest) -> tuple[str | None, str]:
    """(system prompt, question) of a request with documents: the prompt string, or the last
    user message after at most one system message."""
    if request.messages is None:
        if not isinstance(request.prompt, str):
            raise BadInput("with 'documents', 'prompt' must be the question as a string")
        return None, request.prompt
    roles = [m["role"] for m in request.messages]
    if roles not in (["user"], ["system", "user"], ["developer", "user"]):
        raise BadInput("with 'documents', send at most one system message and one user message (the question): "
                       "the documents are placed before it")
    return (request.messages[0]["content"] if len(roles) == 2 else None), request.messages[-1]["content"]


def context_length(model: Any) -> int | None:
    """The context length the model's config states, if any."""
    args = getattr(model, "args", None)
    for name in _CONTEXT_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
