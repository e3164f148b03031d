"""Sliding-window and chunked-attention layers kept by token, so that an entry is reused by prefix.

mlx-lm's `RotatingKVCache` holds only the last `max_size` rows (and its first `keep`), and
`ChunkedKVCache` only the rows of its attention chunk, so neither can be cut back to a
shorter prefix. A prefill therefore logs every token's row of these layers as it goes
(`WindowRows`); the snapshot stores them as a RAW layer whose config names the window class
(`window_record`), cut into blocks like any attention layer, and a restore of any prefix
rebuilds the window from its rows (`from_rows`).

What is rebuilt is the *settled* window (`settle`): a ring buffer in temporal order holding
its `keep` rows and the last `max_size - keep` ones; a chunked cache holding the rows from
`offset - chunk_size`. The rows a cache holds after a prefill depend on how the prefill was
chunked (a ring buffer keeps `max_size - 1 + chunk` rows after a chunk), but every update
starts by cutting them to the settled ones (a ring buffer to `max_size - 1` in temporal order, a
chunked cache in `maybe_trim_front`), so a settled cache continues exactly like the one it was
settled from; the engine settles its caches after every prefill, so that a restored prefix
and a prefill of it hold the same arrays.
"""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx
from mlx_lm.models.cache import CacheList, ChunkedKVCache, RotatingKVCache

from turboquant.cache.buffers import detach
from turboquant.records import (
    TOKEN_AXIS,
    LayerRecord,
    Layout,
    Path,
    Snapshot,
    child_path,
    leaf_records,
)

WINDOW_CLASSES = {"RotatingKVCache": RotatingKVCache, "ChunkedKVCache": ChunkedKVCache}


def is_window(cache: Any) -> bool:
    """Whether `cache` is one of mlx-lm's window caches (ring buffer or chunked)."""
    return type(cache) in WINDOW_CLASSES.values()


def leaves(caches: list[Any] | tuple[Any, ...]) -> list[tuple[Path, Any]]:
    """Every cache of a model's caches that is not a CacheList, with its path: its layer index,
    or (layer, member, ...) for the members of a CacheList, at any depth."""
    out: list[tuple[Path, Any]] = []
    for i, c in enumerate(caches):
        if type(c) is CacheList:
            out += [(child_path(i, p) if isinstance(p, int) else (i, *p), m) for p, m in leaves(c.caches)]
        else:
            out.append((i, c))
    return out


def member(caches: list[Any], path: Path) -> Any:
    """The cache at `path` (a layer index, or a CacheList member's path from `leaves`)."""
    if isinstance(path, int):
        return caches[path]
    cache = caches[path[0]]
    for j in path[1:]:
        cache = cache.caches[j]
    return cache


def window_layers(caches: list[Any]) -> list[Path]:
    """The paths of the window layers among a model's caches (CacheList members included)."""
    return [p for p, c in leaves(caches) if is_window(c)]


WINDOW_MODES = ("token", "whole")


def window_config(cache: Any, by_token: bool) -> dict:
    """The data-independent scalars of a window cache (what the codec identity hashes); `rows`
    "token" marks an entry that keeps its windows by token, so that its blocks never share a
    key with those of an entry that keeps them whole (which hold no window rows)."""
    if type(cache) is RotatingKVCache:
        config = {"class": "RotatingKVCache", "max_size": cache.max_size, "keep": cache.keep}
    else:
        config = {"class": "ChunkedKVCache", "chunk_size": cache.chunk_size}
    return {**config, "rows": "token"} if by_token else config


def is_window_record(record: LayerRecord) -> bool:
    """Whether a RAW record holds a window layer's rows by token."""
    return record.layout is Layout.RAW and record.config.get("class") in WINDOW_CLASSES


def window_record(cache: Any, keys: mx.array, values: mx.array) -> LayerRecord:
    """A window layer as a RAW record of every token's row (`keys`/`values` from token 0)."""
    tokens = keys.shape[TOKEN_AXIS]
    arrays = {"keys": keys, "values": values} if tokens or cache.keys is not None else {}
    return LayerRecord(Layout.RAW, tokens, arrays, window_config(cache, True))


def settle(cache: Any) -> None:
    """Cut a window cache to its settled rows, in place (see the module docstring)."""
    if cache.keys is None:
        return
    if type(cache) is ChunkedKVCache:
        cache.maybe_trim_front()
        cache.state = (*cache.keys_and_values(), cache.offset, cache.chunk_size, cache.start_position)
        return
    keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    keys, values = keys[..., :cache.offset, :], values[..., :cache.offset, :]
    if keys.shape[TOKEN_AXIS] > cache.max_size:
        keys, values = (_ring_rows(a, cache.keep, cache.max_size) for a in (keys, values))
    cache.state = (detach(keys), detach(values), cache.offset, cache.keep, cache.max_size, keys.shape[TOKEN_AXIS])


def settle_all(caches: list[Any]) -> None:
    """`settle` every window cache of a model's caches (CacheList members included)."""
    for _, c in leaves(caches):
        if is_window(c):
            settle(c)


def _ring_rows(rows: mx.array, keep: int, max_size: int) -> mx.array:
    """A ring buffer's settled rows out of rows in temporal order: the first `keep`, the last
    `max_size - keep`."""
    n = rows.shape[TOKEN_AXIS]
    if n <= max_size:
        return rows
    return mx.concatenate([rows[..., :keep, :], rows[..., n - (max_size - keep):, :]], axis=TOKEN_AXIS)


def from_rows(record: LayerRecord) -> Any:
    """The settled window cache of a RAW window record (every row from token 0)."""
    config, n = record.config, record.offset
    if config["class"] == "RotatingKVCache":
        cache = RotatingKVCache(max_size=int(config["max_size"]), keep=int(config["keep"]))
        if n:
            keys, values = (detach(_ring_rows(record.arrays[s], cache.keep, cache.max_size)) for s in ("keys", "values"))
            cache.state = (keys, values, n, cache.keep, cache.max_size, keys.shape[TOKEN_AXIS])
        return cache
    cache = ChunkedKVCache(int(config["chunk_size"]))
    if n:
        start = max(0, n - cache.chunk_size)
        keys, values = (detach(record.arrays[s][..., start:, :]) for s in ("keys", "values"))
        cache.state = (keys, values, n, cache.chunk_size, start)
    return cache


def _last_rows(cache: Any, n: int) -> tuple[mx.array, mx.array]:
    """The rows of the last `n` tokens a window cache took in: all of one multi-token update,
    or (decode steps) as many as its window still holds."""
    if type(cache) is ChunkedKVCache:
        keys, values = cache.keys_and_values()
    else:
        keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    if keys.shape[TOKEN_AXIS] - (cache.keep if type(cache) is RotatingKVCache else 0) < n:
        raise ValueError(f"a window cache no longer holds the rows of its last {n} tokens: log them after each update")
    return keys[..., -n:, :], values[..., -n:, :]


class WindowRows:
    """Every token's row of a model's window layers, from token 0, logged after each update.

    Complete only when it starts at token 0 (a fresh prefill, or a restore of rows stored by
    token); a log that starts later (a window restored whole) gives no rows, and the entry then
    stores its windows whole.
    """

    def __init__(self, layers: list[Path], seen: int = 0, rows: Mapping[Path, tuple[mx.array, mx.array]] | None = None):
        self.seen = seen
        self.complete = seen == 0 or rows is not None
        self.parts: dict[Path, list[tuple[mx.array, mx.array]]] = {i: [] for i in layers}
        for i, kv in (rows or {}).items():
            self.parts[i].append(kv)

    @classmethod
    def from_snapshot(cls, snap: Snapshot) -> "WindowRows":
        """The log of a restored snapshot: its window rows when every window layer is stored by
        token, else an incomplete log."""
        found = {p: r for p, r in leaf_records(snap.layers) if r.config.get("class") in WINDOW_CLASSES}
        layers = list(found)
        by_token = all(is_window_record(r) for r in found.values())
        rows = {p: (r.arrays["keys"], r.arrays["values"]) for p, r in found.items() if r.offset} if by_token else None
        seen = max((r.offset for r in found.values()), default=0)
        out = cls(layers, seen, rows)
        out.complete = by_token
        return out

    def record(self, caches: list[Any], seen: int) -> None:
        """Log the rows of the tokens the caches took in since the last call (one update per
        layer: a prefill chunk or a decode step), `seen` tokens in all."""
        n = seen - self.seen
        if n > 0:
            # Copied and evaluated now: a view would keep the whole ring of every step alive.
            new = [tuple(mx.contiguous(a) for a in _last_rows(member(caches, i), n)) for i in self.parts]
            mx.eval(new)
            for i, rows in zip(self.parts, new):
                self.parts[i].append(rows)
        self.seen = seen

    def follow(self, caches: list[Any]) -> None:
        """Log the rows of the tokens the window caches took in since the last call, whatever
        their number (generation feeds tokens one decode step at a time, ahead of what it yields)."""
        self.record(caches, max((member(caches, i).offset for i in self.parts), default=self.seen))

    def rows(self, tokens: int) -> dict[Path, tuple[mx.array, mx.array]] | None:
        """Each window layer's rows of tokens [0, tokens), or None when the log lacks some."""
        if not self.complete or self.seen < tokens:
            return None
        out = {}
        for i, parts in self.parts.items():
            if not parts:
                return None if tokens else {}
            keys, values = (mx.concatenate([p[s] for p in parts], axis=TOKEN_AXIS) if len(parts) > 1 else parts[0][s]
                            for s in (0, 1))
            out[i] = (keys[..., :tokens, :], values[..., :tokens, :])
            self.parts[i] = [(keys, values)]
        return out
