"""Several rows' compressed caches in one decode step's attention (a server's batch).

Each row keeps its own `TurboQuantKVCache` (its own codec sides, calibration, block means and
raw tail); a `RowStack` keeps their buffers stacked along the batch axis, each row's own
calibration and block means beside the others', and `rows_attention` attends every row over
its own rows in one set of ops instead of one set per row. Rows whose layers share a stored
layout (the same plan as stored: `stack_key`) stack, on the plain-ops path (the CPU,
`RowStack.applies`). On CUDA, short rows attend over decoded mirrors instead, stacked by
`mirror.DecodedStack`; on Metal each row keeps its own kernel calls.

What a stack costs: a copy of its rows' compressed rows and a raw tail of TAIL_ROWS rows per
row, per layer (the server stacks rows under 1,024 tokens), and a copy of every row again
whenever one of them encodes a block (every 256 tokens) or the set of rows changes.
"""

from __future__ import annotations

from collections.abc import Hashable

import mlx.core as mx

from turboquant.attention import kernels
from turboquant.attention.rows import rows_attention
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.cache.mirror import HeldRows
from turboquant.codec.calibration import KeyCalibration


def stack_key(cache: TurboQuantKVCache) -> Hashable | None:
    """Caches with equal keys can share a `RowStack`; None: this one attends alone
    (not compressed yet, nothing stored, or more than one row)."""
    if not cache.compressed or not cache.stored:
        return None
    memo = cache.stack_memo
    if memo is None or memo[0] is not cache.active:
        # (a cache's batch is its arrays' and never changes until a trim to zero resets it: a
        # decode step asks every layer of every row, and `batch` looks through its buffers)
        memo = (cache.active, tuple(sorted(cache.active.meta().items())) if cache.batch == 1 else None)
        cache.stack_memo = memo
    return memo[1]


TAIL_ROWS = 256  # a row's raw tail holds at most this many rows after a decode step (compressed.py)


class RowStack(HeldRows):
    """One layer's rows of one `stack_key`, kept stacked across decode steps.

    The first step over a set of rows (and any step after one of them changed otherwise than by
    this step's row: a block encoded, a step taken back, rows joining or leaving) gives each
    cache its row and copies their buffers in; the steps after that write the rows' new keys and
    values into the stacked tails with one scatter, their caches only counting them
    (`TurboQuantKVCache.lend`, as a raw decode batch's group holds its rows). The rows' own
    caches stay the record (what is encoded, trimmed and saved): they take their lent rows back
    whenever something reads their tails.
    """

    def __init__(self):
        super().__init__()
        self._arrays: dict[str, mx.array] = {}
        self._tail: tuple[mx.array, mx.array] | None = None
        self._shifts: mx.array | None = None
        self._key_side = None

    @staticmethod
    def applies() -> bool:
        """Whether rows stack here: on the plain-ops path (the CPU). On a GPU the fused kernels
        read one row's buffers with one stored length, and stacked plain ops measured no faster
        than those one row at a time (docs/server.md)."""
        return kernels.select_backend() is None

    def attend(self, caches: list[TurboQuantKVCache], keys: mx.array, values: mx.array, queries: mx.array,
               scale: float) -> mx.array:
        """Attention of one query token per row (queries [G, Hq, 1, D]) over each row's cache and
        this step's row (`keys`, `values` [G, H, 1, D]), which this call adds to the caches:
        [G, Hq, 1, D]. The caches share one `stack_key`."""
        self.add_rows(caches, keys, values)
        stored = [c.stored for c in caches]
        tails = [c.offset - c.stored for c in caches]
        longest = max(tails)
        tail = None if not longest else (self._tail[0][:, :, :longest], self._tail[1][:, :, :longest])
        return rows_attention(queries, self._key_side, caches[0]._value_side, self._arrays, stored, self._shifts,
                              tail, tails, scale)

    def _buffers(self) -> tuple[mx.array, mx.array] | None:
        return self._tail

    def _origin(self, cache: TurboQuantKVCache) -> int:
        return cache.stored  # the stacked tails

    def _build(self, caches: list[TurboQuantKVCache]) -> None:
        first = caches[0]
        stored = max(c.stored for c in caches)
        self._arrays = {name: _stacked([c._store.arrays[name] for c in caches], stored)
                        for name in first._store.arrays}
        plan = first.plan
        self._tail = tuple(_stacked([c._tail.arrays.get(name) if c.offset > c.stored else None for c in caches],
                                    TAIL_ROWS, mx.zeros((1, plan.n_kv_heads, 0, d), first.native_dtype))
                           for name, d in (("keys", plan.head_dim_k), ("values", plan.head_dim_v)))
        self._shifts = None
        if first._shifts is not None:
            self._shifts = _stacked([c._shifts[None] for c in caches], max(c._shifts.shape[1] for c in caches))
        self._key_side = first.active.key.side("keys", _stacked_calibration(caches))


def _stacked(pieces: list[mx.array | None], n: int, like: mx.array | None = None) -> mx.array:
    """Rows' buffers [1, H, tokens (or blocks), ...] cut or zero-padded to n along axis 2, as one
    [rows, H, n, ...] array (None: zeros shaped like the others, or like `like`)."""
    like = next((p for p in pieces if p is not None), like)

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
