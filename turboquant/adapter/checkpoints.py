"""Recurrent states at block boundaries (and window rows), so that an entry can be reused by prefix.

A recurrent (ArraysCache) state cannot be cut back to fewer tokens the way attention rows can,
so the prefill runs in chunks that end on every block boundary and the state of every
recurrent layer is kept at each one. A snapshot stores them as `state<j>@<t>` arrays; the store
puts each block's end state into that block, and restoring k blocks gives the state at their end.
Costs one state per recurrent layer and block (docs/models.md gives the bytes per block). A
model's own cache class of `records.FIELD_PLANS` is kept the same way: its replaced fields at
every block end, and the row count of the fields that only grow.
Sliding-window and chunked layers log every token's row instead (`windows.WindowRows`).
"""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from turboquant.adapter.snapshots import fields_class, held_tokens
from turboquant.adapter.windows import WindowRows, leaves, member, window_layers
from turboquant.records import (
    FIELD_PLANS,
    Layout,
    Path,
    Snapshot,
    child_path,
    field_boundaries,
    field_plan,
    fields_at,
    leaf_records,
    state_at,
    state_boundaries,
    state_boundary,
)


def recurrent_layers(caches: list[Any]) -> list[Path]:
    """The paths of the recurrent-state (ArraysCache) layers, CacheList members included (a
    member's path is (layer, member, ...), as `windows.leaves` gives it)."""
    return [p for p, c in leaves(caches) if type(c) is ArraysCache]


def field_layers(caches: list[Any]) -> list[Path]:
    """The paths of the layers of a model's own cache class that is cut at block ends (`FIELD_PLANS`)."""
    return [p for p, c in leaves(caches) if fields_class(c) in FIELD_PLANS]


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
        # {path: {tokens: an ArraysCache's states, or a FIELD_PLANS class's (end fields, grown rows)}}
        self.layers: dict[Path, dict[int, Any]] = {}

    @property
    def boundary(self) -> int | None:
        """Where prefill chunks must end as well (every block end, for recurrent states)."""
        return self.block if self.states else None

    @classmethod
    def for_caches(cls, caches: list[Any], block: int, rows: bool = True) -> "StateCheckpoints | None":
        """The checkpoints a fresh prefill into `caches` keeps (None when every layer can be cut);
        window rows only with `rows` (an entry that keeps its windows whole needs none)."""
        windows = window_layers(caches) if rows else []
        states = bool(recurrent_layers(caches) or (rows and field_layers(caches)))
        if not windows and not states:
            return None
        return cls(block, WindowRows(windows) if windows else None, states)

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
            if field_plan(r) is not None:
                for t in [*field_boundaries(r), r.offset]:
                    if t and t % block == 0:
                        out.layers.setdefault(i, {})[t] = fields_at(r, t)
                continue
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
        for i in field_layers(caches):
            cache, plan = member(caches, i), FIELD_PLANS[fields_class(member(caches, i))]
            self.layers.setdefault(i, {})[seen] = (
                {f: getattr(cache, f) for f in plan.ends},
                {f: 0 if getattr(cache, f) is None else getattr(cache, f).shape[plan.axis] for f in plan.grows})

    def before(self, tokens: int) -> dict[Path, dict[int, Any]]:
        """The checkpoints strictly before `tokens` (the state at `tokens` is the cache's own)."""
        return {i: {t: s for t, s in by_t.items() if t < tokens} for i, by_t in self.layers.items()}

    def rows(self, tokens: int):
        """The window layers' rows of tokens [0, tokens) (`WindowRows.rows`), or None."""
        return self.windows.rows(tokens) if self.windows is not None else None

    def last_end(self, caches: list[Any], tokens: int) -> int:
        """The last block end at or before `tokens` at which every recurrent layer's state was
        kept (0: none); a model's own cache classes (`FIELD_PLANS`) are not covered: 0."""
        paths = recurrent_layers(caches)
        if not paths or field_layers(caches):
            return 0
        end = tokens // self.block * self.block
        while end > 0 and not all(end in self.layers.get(p, {}) for p in paths):
            end -= self.block
        return end

    def caches_at(self, caches: list[Any], end: int) -> list[Any]:
        """`caches` whose recurrent layers hold the state kept at `end` (`last_end`), for a
        snapshot of the first `end` tokens after the caches went on (an answer decoded into
        them): new ArraysCache objects, CacheLists rebuilt around them, every other layer the
        same object."""
        def at(path: Path, cache: Any) -> Any:
            if type(cache) is CacheList:
                return CacheList(*(at(child_path(path, j), m) for j, m in enumerate(cache.caches)))
            if type(cache) is ArraysCache:
                kept = ArraysCache(len(cache.cache))
                kept.cache = list(self.layers[path][end])
                return kept
            return cache

        return [at(i, c) for i, c in enumerate(caches)]

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
