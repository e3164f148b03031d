"""Recurrent states at block boundaries (and window rows), so that an entry can be reused by prefix.

A recurrent (ArraysCache) state cannot be cut back to fewer tokens the way attention rows can,
so the prefill runs in chunks that end on every block boundary and the state of every
recurrent layer is kept at each one. A snapshot stores them as `state<j>@<t>` arrays; the store
puts each block's end state into that block, and restoring k blocks gives the state at their end.
Costs one state per recurrent layer and block (docs/models.md gives the bytes per block).
Sliding-window and chunked layers log every token's row instead (`windows.WindowRows`).
"""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .integration import held_tokens
from .records import Layout, Path, Snapshot, leaf_records, state_at, state_boundaries, state_boundary
from .windows import WindowRows, leaves, member, window_layers


def recurrent_layers(caches: list[Any]) -> list[Path]:
    """The paths of the recurrent-state (ArraysCache) layers, CacheList members included (a
    member's path is (layer, member, ...), as `windows.leaves` gives it)."""
    return [p for p, c in leaves(caches) if type(c) is ArraysCache]


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
    """What a prefill keeps so that a prefix of its entry can be restored: the recurrent states
    at every multiple of `block` tokens (chunks end there, `boundary`) and, with `windows`, the
    rows of every token of the window layers."""

    def __init__(self, block: int, windows: WindowRows | None = None, states: bool = True):
        self.block = block
        self.windows = windows
        self.states = states
        self.layers: dict[Path, dict[int, list[mx.array | None]]] = {}

    @property
    def boundary(self) -> int | None:
        """Where prefill chunks must end as well (every block end, for recurrent states)."""
        return self.block if self.states else None

    @classmethod
    def for_caches(cls, caches: list[Any], block: int, rows: bool = True) -> "StateCheckpoints | None":
        """The checkpoints a fresh prefill into `caches` keeps (None when every layer can be cut);
        window rows only with `rows` (an entry that keeps its windows whole needs none)."""
        windows = window_layers(caches) if rows else []
        if not windows and not recurrent_layers(caches):
            return None
        return cls(block, WindowRows(windows) if windows else None, bool(recurrent_layers(caches)))

    @classmethod
    def from_snapshot(cls, snap: Snapshot, block: int, caches: list[Any], rows: bool = True
                      ) -> "StateCheckpoints | None":
        """The checkpoints a restored snapshot holds (its current state and window rows
        included), so that a prefill continuing from it into `caches` stores them again."""
        out = cls.for_caches(caches, block, rows)
        if out is None:
            return None
        if out.windows is not None:
            out.windows = WindowRows.from_snapshot(snap)
        for i, r in leaf_records(snap.layers):
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
        """Keep every recurrent layer's state when `seen` tokens end a block, and the window
        rows of the tokens since the last call."""
        if self.windows is not None:
            self.windows.record(caches, seen)
        if seen and seen % self.block == 0:
            self.record_states(caches, seen)

    def record_states(self, caches: list[Any], seen: int) -> None:
        """Keep every recurrent layer's state after `seen` tokens."""
        for i in recurrent_layers(caches):
            self.layers.setdefault(i, {})[seen] = list(member(caches, i).cache)

    def before(self, tokens: int) -> dict[Path, dict[int, list[mx.array | None]]]:
        """The checkpoints strictly before `tokens` (the state at `tokens` is the cache's own)."""
        return {i: {t: s for t, s in by_t.items() if t < tokens} for i, by_t in self.layers.items()}

    def rows(self, tokens: int):
        """The window layers' rows of tokens [0, tokens) (`WindowRows.rows`), or None."""
        return self.windows.rows(tokens) if self.windows is not None else None

    def follow(self, caches: list[Any]) -> None:
        """Log what generation adds, one decode step at a time: the window rows of the tokens
        since the last call (`WindowRows.follow`) and the recurrent states when the caches hold
        a block's end. Called after every step, so that no block end is passed unseen (mlx-lm
        feeds the prompt's last token and the first answer token before the first yield: a
        block end right after the prompt is missed, and the states are then stored whole)."""
        if self.windows is not None:
            self.windows.follow(caches)
        seen = held_tokens(caches)
        if self.states and seen and seen % self.block == 0:
            self.record_states(caches, seen)
