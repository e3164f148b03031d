"""Turning a document and questions into tokens the way mlx-lm does, without boundary merges.

A context is stored as the tokens of the chat template rendered up to the end of the document
(inside the user turn). A question is appended as the tokens of (separator + question + the
template's turn suffix) encoded on their own: re-tokenizing the whole text would let tokens
merge across the boundary, and the stored prefix would no longer match.

Text encoded on its own is still encoded as text that follows other text (`_continuation`):
sentencepiece tokenizers (Llama-2, Mistral) put a space ('▁') before the start of what
they encode, and a question carrying that space has a token the conversation does not.

Where the user's text ends inside the rendered template is found with a marker that must occur
exactly once in the rendering (`_locate`); user text can hold any string, this marker included,
so when it does, a random marker is used instead: a document is never cut by its own text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

from tqstore.errors import BadInput

SENTINEL = "\u2063TQSTORE-SPLIT\u2063"
QUESTION_SEPARATOR = "\n\n"
DOCUMENT_SEPARATOR = "\n\n"
PLAIN_QUESTION = "\n\nQuestion: {question}\nAnswer:"
# What `_continuation` encodes before a text: a letter, which tokenizers keep apart from the
# newlines and template text that continuations start with.
CONTINUATION_PROBE = "a"


@dataclass(frozen=True)
class PromptFormat:
    """How a tokenizer frames a context and a question."""

    chat: bool
    suffix: str  # text after the user content up to the assistant's turn (chat templates)

    def context_tokens(self, tokenizer, document: str, system: str | None = None) -> list[int]:
        """Tokens of the context: template up to and including the document."""
        if not self.chat:
            return _encode(tokenizer, document, first=True)
        text, _, at = _locate(lambda marker: _render(tokenizer, document + marker, system))
        return _encode(tokenizer, text[:at], first=True)

    def question_tokens(self, tokenizer, question: str) -> list[int]:
        """Tokens to append to a stored context for one question (ends where the answer starts)."""
        if not self.chat:
            return _continuation(tokenizer, PLAIN_QUESTION.format(question=question))
        return _continuation(tokenizer, QUESTION_SEPARATOR + question + self.suffix)

    def document_tokens(self, tokenizer, text: str) -> list[int]:
        """Tokens of one document of a composed prompt, encoded on its own so that it tokenizes
        the same wherever it sits; the separator that follows it belongs to it."""
        return _encode(tokenizer, text.strip() + DOCUMENT_SEPARATOR, first=False)

    def after_documents_tokens(self, tokenizer, question: str) -> list[int]:
        """Tokens of the question that follows composed documents, up to where the answer starts."""
        if not self.chat:
            return _encode(tokenizer, PLAIN_QUESTION.format(question=question)[len(QUESTION_SEPARATOR):], first=False)
        return _encode(tokenizer, question + self.suffix, first=False)

    def turn_tokens(self, tokenizer, next_question: str) -> list[int]:
        """Tokens that close an answer and frame the next question up to its answer (chat turns)."""
        if not self.chat:
            return _continuation(tokenizer, PLAIN_QUESTION.format(question=next_question))
        return _continuation(tokenizer, _render_turns(tokenizer, next_question))


def prompt_format(tokenizer) -> PromptFormat:
    """The framing this tokenizer uses: its chat template, or plain continuation without one."""
    if not getattr(tokenizer, "has_chat_template", False) or not getattr(tokenizer, "chat_template", None):
        return PromptFormat(chat=False, suffix="")
    text, marker, at = _locate(lambda marker: _render(tokenizer, "x" + marker, None))
    return PromptFormat(chat=True, suffix=text[at + len(marker):])


def _render(tokenizer, content: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _render_turns(tokenizer, question: str) -> str:
    """The template text between an assistant answer and the next question's answer start."""
    def render(marker: str) -> str:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" + marker},
                    {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    text, marker, at = _locate(render)
    return text[at + len(marker):]


def _locate(render: Callable[[str], str]) -> tuple[str, str, int]:
    """`render(marker)` and where the marker is in it: (text, marker, index). SENTINEL first (the
    usual case, so tokens never depend on the marker); if the rendering holds it anywhere else
    (user text containing it), a fresh random marker, which user text cannot anticipate."""
    marker = SENTINEL
    for _ in range(4):
        text = render(marker)
        at = text.find(marker)
        if at >= 0 and at == text.rfind(marker):
            return text, marker, at
        marker = f"\u2063TQSTORE-SPLIT-{secrets.token_hex(8)}\u2063"
    raise BadInput("the chat template repeats or drops the user's message, so tqstore cannot tell where the text "
                   "ends in it: use a model whose template renders each message once")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Tokens of a whole prompt as mlx-lm encodes it: special tokens unless the text already
    begins with the BOS token (a rendered chat template writes it)."""
    return _encode(tokenizer, text, first=True)


def _encode(tokenizer, text: str, first: bool) -> list[int]:
    _check_unicode(text)
    bos = getattr(tokenizer, "bos_token", None)
    special = first and (bos is None or not text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=special))


def _continuation(tokenizer, text: str) -> list[int]:
    """Tokens of `text` where it follows other text. A tokenizer that puts a space before what
    it encodes (sentencepiece's dummy prefix: a Metaspace pre-tokenizer, or a Prepend normalizer)
    begins `text` alone with a '▁' that the whole conversation does not have; after a probe
    whose own tokens come out unchanged, it does not. Only such leading pieces, which decode to
    nothing but a space, are ever dropped: any other tokenizer keeps `text`'s tokens as they were
    (a question's tokens must not change under entries already stored with them)."""
    alone = _encode(tokenizer, text, first=False)
    head = list(tokenizer.encode(CONTINUATION_PROBE, add_special_tokens=False))
    both = list(tokenizer.encode(CONTINUATION_PROBE + text, add_special_tokens=False))
    rest = both[len(head):]
    dropped = len(alone) - len(rest)
    if (not head or both[:len(head)] != head or dropped <= 0 or alone[dropped:] != rest
            or tokenizer.decode(alone[:dropped]).strip(" ")):
        return alone
    return rest


def _check_unicode(text: str) -> None:
    """Refuse text holding a lone UTF-16 surrogate, which no tokenizer encodes. Python makes one
    of every byte that is not UTF-8 on the command line (`--prompt $'\\xff'`) or in a file read
    with surrogateescape, so the message names the byte where it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise BadInput(f"the text is not valid UTF-8 ({what}): convert it to UTF-8 first "
                       "(for example `iconv -f latin1 -t utf-8`)") from None
