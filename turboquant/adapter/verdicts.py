"""What making a model's caches learns by running the model, kept for the next process.

`make_prompt_cache` runs the model twice over to decide a scheme's plan: a probe for the plain
layers whose arrays the model code reads itself (`residence.layers_read_by_model`), and the
plan's check, prefill to decode, with its fallbacks (`integration`). Both answers depend on the
model's code, config and shapes, the scheme and its options, never on data, and both are
remembered in memory per model object. A caller that can name a model across processes (by a
digest of its files and the versions of the code that ran the check) registers a `VerdictBook`
for it here, and a second process reads the answers instead of running those forward passes:
several seconds of every fresh `tqstore ask` on a CPU.

The registry holds models weakly: a model that is freed drops its book.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol


class VerdictBook(Protocol):
    """Answers about one model, by key; values are JSON-serializable (lists, strings, None)."""

    def get(self, key: str) -> Any | None:
        """The value kept under `key`, None when there is none."""

    def put(self, key: str, value: Any) -> None:
        """Keep `value` under `key` (a failure to keep it is not an error: it is recomputed)."""


_books: dict[int, tuple[weakref.ref, VerdictBook]] = {}


def register(model: Any, book: VerdictBook) -> None:
    """Consult `book` for `model` from now on (replacing a book registered before)."""
    _books[id(model)] = (weakref.ref(model, lambda _, key=id(model): _books.pop(key, None)), book)


def book_for(model: Any) -> VerdictBook | None:
    """The book registered for `model`, if any."""
    hit = _books.get(id(model))
    if hit is None or hit[0]() is not model:
        return None
    return hit[1]
