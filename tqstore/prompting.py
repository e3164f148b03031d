"""Turning a document and questions into tokens the way mlx-lm does, without boundary merges.

A context is stored as the tokens of the chat template rendered up to the end of the document
(inside the user turn). A question is appended as the tokens of (separator + question + the
template's turn suffix) encoded on their own: re-tokenizing the whole text would let tokens
merge across the boundary, and the stored prefix would no longer match.
"""

from __future__ import annotations

from dataclasses import dataclass

SENTINEL = "\u2063TQSTORE-SPLIT\u2063"
QUESTION_SEPARATOR = "\n\n"
PLAIN_QUESTION = "\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptFormat:
    """How a tokenizer frames a context and a question."""

    chat: bool
    suffix: str  # text after the user content up to the assistant's turn (chat templates)

    def context_tokens(self, tokenizer, document: str, system: str | None = None) -> list[int]:
        """Tokens of the context: template up to and including the document."""
        if not self.chat:
            return _encode(tokenizer, document, first=True)
        text = _render(tokenizer, document + SENTINEL, system)
        return _encode(tokenizer, text[: text.index(SENTINEL)], first=True)

    def question_tokens(self, tokenizer, question: str) -> list[int]:
        """Tokens to append to a stored context for one question (ends where the answer starts)."""
        if not self.chat:
            return _encode(tokenizer, PLAIN_QUESTION.format(question=question), first=False)
        return _encode(tokenizer, QUESTION_SEPARATOR + question + self.suffix, first=False)

    def turn_tokens(self, tokenizer, next_question: str) -> list[int]:
        """Tokens that close an answer and frame the next question up to its answer (chat turns)."""
        if not self.chat:
            return _encode(tokenizer, PLAIN_QUESTION.format(question=next_question), first=False)
        text = _render_turns(tokenizer, next_question)
        return _encode(tokenizer, text, first=False)


def prompt_format(tokenizer) -> PromptFormat:
    """The framing this tokenizer uses: its chat template, or plain continuation without one."""
    if not getattr(tokenizer, "has_chat_template", False) or not getattr(tokenizer, "chat_template", None):
        return PromptFormat(chat=False, suffix="")
    text = _render(tokenizer, "x" + SENTINEL, None)
    return PromptFormat(chat=True, suffix=text[text.index(SENTINEL) + len(SENTINEL):])


def _render(tokenizer, content: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _render_turns(tokenizer, question: str) -> str:
    """The template text between an assistant answer and the next question's answer start."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" + SENTINEL},
                {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text[text.index(SENTINEL) + len(SENTINEL):]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Tokens of a whole prompt as mlx-lm encodes it: special tokens unless the text already
    begins with the BOS token (a rendered chat template writes it)."""
    return _encode(tokenizer, text, first=True)


def _encode(tokenizer, text: str, first: bool) -> list[int]:
    bos = getattr(tokenizer, "bos_token", None)
    special = first and (bos is None or not text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=special))
