"""Short prefills of several generations in one forward pass (the server's requests that arrive
together): `prefill_rows`.

Each `PrefillRow` (tqstore/engine/prefill.py) holds its own caches, raw or TurboQuant, fresh or
holding a restored prefix. The rows' tokens run as one [rows, longest] input, right-padded:
embeddings, projections, norms and MLPs run batched. Attention runs per row, over exactly its
own tokens: its cache takes only its real rows (`ChunkLayer`) and its queries are cut to them,
so each row's cache update and attention have the shapes of the row's prefill alone (a
TurboQuant cache's query statistics included) and the padding reaches no cache. The fresh
compressed layers of all rows are then encoded together. Before, requests arriving together
each paid a pass and an encoding of their own and joined the decode steps one by one.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from turboquant import TurboQuantKVCache, compressed_sdpa, start_decoding

from tqstore.engine.prefill import PrefillRow, body

# The caches a row may hold (batch.py's `batchable` asks the same of a model's layers).
ROW_CACHES = (KVCache, TurboQuantKVCache)


class ChunkKeys:
    """What a shared prefill's layer returns as its keys (and values): each row's fetched keys,
    values and cache, and its number of real tokens."""

    def __init__(self, rows: list[tuple[Any, Any, Any]], lengths: list[int]):
        self.rows = rows
        self.lengths = lengths

    def attend(self, queries: mx.array, scale: float, sinks=None) -> mx.array:
        """Each row's attention over its own cache, its real queries only (causal, as its prefill
        alone); the padded positions' outputs are zeros."""
        width = queries.shape[2]
        outs = []
        for i, ((k, v, cache), n) in enumerate(zip(self.rows, self.lengths)):
            out = compressed_sdpa(queries[i:i + 1, :, :n], k, v, cache=cache, scale=scale,
                                  mask="causal" if n > 1 else None, sinks=sinks)
            outs.append(out if n == width else mx.pad(out, [(0, 0), (0, 0), (0, width - n), (0, 0)]))
        return mx.concatenate(outs, axis=0)


class ChunkLayer:
    """One layer's caches in a shared prefill, as the model sees one cache: per-row offsets (RoPE
    takes an array); each row's real rows into its own cache."""

    def __init__(self, caches: list[Any], offset: int | mx.array, lengths: list[int]):
        self.caches, self.offset, self.lengths = caches, offset, lengths

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[ChunkKeys, ChunkKeys]:
        rows = [(*cache.update_and_fetch(keys[i:i + 1, :, :n], values[i:i + 1, :, :n]), cache)
                for i, (cache, n) in enumerate(zip(self.caches, self.lengths))]
        fetched = ChunkKeys(rows, self.lengths)
        return fetched, fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # each row's causal mask is its own (ChunkKeys.attend)


def prefill_rows(model: Any, rows: Sequence[PrefillRow]) -> float:
    """Run every row's tokens into its caches in one forward pass, then compress the TurboQuant
    layers the pass left raw that hold a block or more (fresh prompts'; shorter ones defer),
    every row's in lockstep, as each row's `Context.start_decoding` would on its own; sets each
    row's `seconds` (the whole) and returns them. The rows' layers must be plain attention
    caches (raw or TurboQuant: `batch.batchable`), which `rows_sdpa` attends per row."""
    t0 = time.perf_counter()
    if any(type(c) not in ROW_CACHES for row in rows for c in row.caches):
        raise ValueError("a shared prefill takes only plain attention caches (raw or TurboQuant)")
    lengths = [len(row.tokens) for row in rows]
    width = max(lengths)
    # Padding repeats a row's last token: any id runs, and nothing it computes is kept.
    inputs = mx.array([row.tokens + [row.tokens[-1]] * (width - len(row.tokens)) for row in rows])
    offsets = [row.caches[0].offset for row in rows]
    offset = offsets[0] if len(set(offsets)) == 1 else mx.array(offsets)
    layers = [ChunkLayer([row.caches[i] for row in rows], offset, lengths) for i in range(len(rows[0].caches))]
    body(model)(inputs, cache=layers)
    mx.eval([c.state for row in rows for c in row.caches])
    # One evaluation per decision of the encoding for all rows: one row's start_decoding took
    # 12 ms on an H100 (three waits, each behind the other requests' steps in flight), paid
    # one row after another.
    start_decoding([c for row in rows for c in row.caches])
    seconds = time.perf_counter() - t0
    for row in rows:
        row.seconds = seconds
    return seconds
