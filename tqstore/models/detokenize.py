"""Streaming detokenizers: text as tokens arrive, exactly as mlx-lm's (tokenizer_utils.py, MIT)
produce it, for the tokenizers `light.py` loads without transformers.

`add_token` takes one id, `last_segment` is the text that became printable since it was last
read, `finalize` flushes what was held back (an incomplete UTF-8 character, a lone space).
"""

from __future__ import annotations

import functools
from collections.abc import Callable


class _Streaming:
    text: str
    offset: int

    @property
    def last_segment(self) -> str:
        """The text that became readable since the last call."""
        segment = self.text[self.offset:]
        self.offset = len(self.text)
        return segment


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    char_to_bytes, n = {}, 0
    limits = [0, ord("!"), ord("~") + 1, ord("¡"), ord("¬") + 1, ord("®"), ord("ÿ") + 1]
    for i, (start, stop) in enumerate(zip(limits, limits[1:])):
        for b in range(start, stop):
            if i % 2 == 0:
                char_to_bytes[chr(2**8 + n)] = b
                n += 1
            else:
                char_to_bytes[chr(b)] = b
    return char_to_bytes


class BPEDetokenizer(_Streaming):
    """Byte-level BPE (GPT-2 style): text flushed when it decodes whole and does not end in a
    lone space (which the next token may absorb)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokenmap = tokens
        self.reset()

    def reset(self) -> None:
        self.offset, self._unflushed, self.text, self.tokens = 0, "", "", []

    def _decode_bytes(self, seq: str) -> str:
        byte_decoder = _byte_decoder()
        barr = bytearray()
        for c in seq:
            res = byte_decoder.get(c, False)
            if res:
                barr.append(res)
            else:
                barr.extend(bytes(c, "utf-8"))
        return barr.decode("utf-8", "replace")

    def _maybe_trim_space(self, current: str) -> str:
        if current and current[0] == " " and not self.text:
            return current[1:]
        return current

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        v = self.tokenmap[token] if token < len(self.tokenmap) else "!"  # mlx-lm's fallback for padded vocabularies
        self._unflushed += v
        text = self._decode_bytes(self._unflushed)
        if not text.endswith("\ufffd") and not (len(v) == 1 and _byte_decoder().get(v[0]) == 32):
            self.text += self._maybe_trim_space(text)
            self._unflushed = ""

    def finalize(self) -> None:
        byte_decoder = _byte_decoder()
        current = bytearray(byte_decoder[c] for c in self._unflushed).decode("utf-8", "replace")
        self.text += self._maybe_trim_space(current)
        self._unflushed = ""


class SPMDetokenizer(_Streaming):
    """SentencePiece: "▁" is a space, <0xNN> tokens are bytes; the first space trimmed unless
    `trim_space` is False."""

    _sep = "\u2581".encode("utf-8")

    def __init__(self, tokens: list[str], trim_space: bool = True) -> None:
        self.trim_space = trim_space
        self.tokenmap = [bytes([int(t[3:5], 16)]) if t.startswith("<0x") else t.encode("utf-8") for t in tokens]
        self.reset()

    def reset(self) -> None:
        self.offset, self._unflushed, self.text, self.tokens = 0, b"", "", []

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if not self.text and self.trim_space and text and text[0] == " ":
            text = text[1:]
        self.text += text
        self._unflushed = b""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._unflushed += self.tokenmap[token]
        self._try_flush()

    def finalize(self) -> None:
        self._try_flush(force=True)
        self._unflushed = b""


class NaiveDetokenizer(_Streaming):
    """Any tokenizer: the tokens since the last newline decoded again at every read (text ending
    in an incomplete character held back, and a trailing space where decoding cleans spaces)."""

    def __init__(self, decode: Callable[[list[int]], str], clean_spaces: bool) -> None:
        self._decode, self._clean_spaces = decode, clean_spaces
        self.reset()

    def reset(self) -> None:
        self.offset, self.tokens, self._text, self._current_tokens, self._current_text = 0, [], "", [], ""

    def add_token(self, token: int) -> None:
        self._current_tokens.append(token)
        self.tokens.append(token)

    def finalize(self) -> None:
        self._text += self._decode(self._current_tokens)
        self._current_tokens, self._current_text = [], ""

    @property
    def text(self) -> str:  # type: ignore[override]
        if self._current_tokens:
            self._current_text = self._decode(self._current_tokens)
            if self._current_text.endswith("\ufffd"):
                self._current_text = self._current_text.rstrip("\ufffd")
            elif self._clean_spaces and self._current_text and self._current_text[-1] == " ":
                self._current_text = self._current_text[:-1]
        if self._current_text and self._current_text[-1] == "\n":
            self._text += self._current_text
            self._current_tokens.clear()
            self._current_text = ""
        return self._text + self._current_text
