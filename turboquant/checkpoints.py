"""Recurrent states at block boundaries, so that a hybrid model's entry can be reused by prefix.

A recurrent (ArraysCache) state cannot be cut back to fewer tokens the way attention rows can,
so the prefill runs in chunks that end on every block boundary and the state of every
recurrent layer is kept at each one. A snapshot stores them as `state<j>@<t>` arrays; the store
puts each block's end state into that block, and restoring k blocks gives the state at their end.
Costs one state per recurrent layer and block (docs/models.md gives the bytes per block).
"""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .records import Layout, Snapshot, state_at, state_boundaries, state_boundary


def recurrent_layers(caches: list[Any]) -> list[int]:
    """The indices of the recurrent-state (ArraysCache) layers."""
    return [i for i, c in enumerate(caches) if type(c) is ArraysCache]


def chunk_ends(start: int, stop: int, chunk: int, block: int | None) -> Iterator[int]:
    """Where prefill chunks of at most `chunk` tokens over [start, stop) end; with `block`,
    every multiple of `block` is an end too (the token positions are absolute)."""
    pos = start
    while pos < stop:
        end = min(pos + chunk, stop)
        if block:
            end = min(end, (pos // block + 1) * block)
        yield end
        pos = end


class StateCheckpoints:
    """The recurrent states of a prefill at every multiple of `block` tokens."""

    def __init__(self, block: int):
        self.block = block
        self.layers: dict[int, dict[int, list[mx.array | None]]] = {}

    @classmethod
    def from_snapshot(cls, snap: Snapshot, block: int) -> "StateCheckpoints":
        """The checkpoints a restored snapshot holds (its current state included), so that a
        prefill continuing from it stores them again."""
        out = cls(block)
        for i, r in enumerate(snap.layers):
            if r.layout is not Layout.STATE or not r.arrays:
                continue
            for t in [*state_boundaries(r), r.offset]:
                if t % block == 0:
                    states: list[mx.array | None] = [None] * int(r.config["size"])
                    for name, a in state_at(r, t).items():
                        states[state_boundary(name)[0]] = a
                    out.layers.setdefault(i, {})[t] = states
        return out

    def record(self, caches: list[Any], seen: int) -> None:
        """Keep every recurrent layer's state when `seen` tokens end a block."""
        if seen and seen % self.block == 0:
            for i in recurrent_layers(caches):
                self.layers.setdefault(i, {})[seen] = list(caches[i].cache)

    def before(self, tokens: int) -> dict[int, dict[int, list[mx.array | None]]]:
        """The checkpoints strictly before `tokens` (the state at `tokens` is the cache's own)."""
        return {i: {t: s for t, s in by_t.items() if t < tokens} for i, by_t in self.layers.items()}
