"""Several rows' compressed caches in one decode step's attention (a server's batch).

Each row keeps its own `TurboQuantKVCache` (its own codec sides, calibration, block means and
raw tail); for the step their buffers are stacked along the batch axis, each row's own
calibration and block means beside the others', and `rows_attention` attends every row over
its own rows in one set of ops instead of one set per row. Rows whose layers share a stored
layout (the same plan as stored: `stack_key`) stack; the plain-ops path is what the CPU runs,
and where the fused GPU kernels apply each row keeps its own kernel calls.
"""

from __future__ import annotations

from typing import Hashable

import mlx.core as mx

from turboquant.attention.kernels import select_backend
from turboquant.attention.rows import rows_attention
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.calibration import KeyCalibration


def stack_key(cache: TurboQuantKVCache) -> Hashable | None:
    """Caches with equal keys can attend in one `attend_rows` call; None: this one attends alone
    (not compressed yet, nothing stored, or more than one row)."""
    if not cache.compressed or not cache.stored or cache.batch != 1:
        return None
    memo = cache.__dict__.get("_stack_key")
    if memo is None or memo[0] is not cache.active:
        memo = (cache.active, tuple(sorted(cache.active.meta().items())))
        cache.__dict__["_stack_key"] = memo
    return memo[1]


def attend_rows(caches: list[TurboQuantKVCache], queries: mx.array, scale: float) -> mx.array:
    """Attention of one query token per row (queries [G, Hq, 1, D]) over each row's compressed
    cache, caches of one `stack_key`: [G, Hq, 1, D]."""
    if len(caches) == 1:
        return caches[0].attention(queries, scale)
    if select_backend() is not None:
        return mx.concatenate([c.attention(queries[g:g + 1], scale) for g, c in enumerate(caches)])
    first = caches[0]
    stored = [c.stored for c in caches]
    tails = [c.offset - c.stored for c in caches]
    arrays = {name: _stacked([c._store.arrays[name] for c in caches], max(stored))
              for name in first._store.arrays}
    tail = None
    if max(tails):
        tail = tuple(_stacked([c._tail.arrays.get(name) if n else None for c, n in zip(caches, tails)], max(tails))
                     for name in ("keys", "values"))
    shifts = None
    if first._shifts is not None:
        shifts = _stacked([c._shifts[None] for c in caches], max(c._shifts.shape[1] for c in caches))
    key_side = first.active.key.side("keys", _stacked_calibration(caches))
    return rows_attention(queries, key_side, first._value_side, arrays, stored, shifts, tail, tails, scale)


def _stacked(pieces: list[mx.array | None], n: int) -> mx.array:
    """Rows' buffers [1, H, tokens (or blocks), ...] cut or zero-padded to n along axis 2, as one
    [rows, H, n, ...] array (None: zeros shaped like the others)."""
    like = next(p for p in pieces if p is not None)

    def fit(p: mx.array | None) -> mx.array:
        if p is None:
            return mx.zeros((*like.shape[:2], n, *like.shape[3:]), like.dtype)
        if p.shape[2] >= n:
            return p[:, :, :n]
        return mx.pad(p, [(0, 0), (0, 0), (0, n - p.shape[2])] + [(0, 0)] * (p.ndim - 3))

    return mx.concatenate([fit(p) for p in pieces])


def _stacked_calibration(caches: list[TurboQuantKVCache]) -> KeyCalibration | None:
    """The rows' key calibrations as one, [rows, H, D] per part (ones for a row without that part:
    multiplying by one is exact); None when no row has one."""
    parts = {}
    for name in ("scale", "rotated_scale"):
        own = [None if c.calibration is None else getattr(c.calibration, name) for c in caches]
        like = next((s for s in own if s is not None), None)
        if like is not None:
            parts[name] = mx.stack([mx.ones_like(like) if s is None else s for s in own])
    return KeyCalibration(**parts) if parts else None
