"""A compressed layer's rows decoded beside its storage while its context is short, so that its
attention is MLX's fused SDPA, one op, as a raw cache's is (CUDA).

Why: under about 1k tokens a decode step is bound by the host, not by the bytes it reads, and
the fused kernels cost a compressed layer two custom-kernel launches and their replay where a
raw layer costs one SDPA (H200, `bench/host_cost.py`: 43 against 18 us of host time per layer;
one turbo5v4 stream through the server decoded 0.72x of raw's tokens/s). Reading fewer bytes
buys nothing at these lengths; the launches are the cost.

What it holds: the layer's first `offset` rows as its attention reads them: the stored rows
decoded (`TurboQuantKVCache.dequantized`: codes, norms, calibration and block means, in float32)
and the raw tail as it is, both in the model's dtype. Rounding the decoded rows to that dtype
(2^-9 relative for bfloat16) is far below what the codec itself changes. The storage stays the
record: what is encoded, saved and restored; the mirror is rebuilt from it whenever the stored
rows change (a block encoded, every 256 tokens), after a trim, and after a restore, and it is
dropped once the context passes `mirror_tokens()` (the fused kernels read the compressed bytes
from there on, where their bandwidth pays).

What it costs: the memory of a raw cache of up to that many tokens per compressed layer, and one
decode of the stored rows per block encoded. A decode step writes its new row once, here (as a raw
cache writes its own): while the mirror holds exactly the cache's rows the row goes to the mirror
alone, and the cache's tail copies such rows from it only when something reads the tail (a block
encoded, a snapshot, a trim, the mirror dropped).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from turboquant.attention import kernels
from turboquant.cache.buffers import TokenBuffers

MIRROR_TOKENS = 1024
MIRROR_ENV = "TQSTORE_MIRROR_TOKENS"


def mirror_tokens() -> int:
    """Contexts up to this many tokens attend over decoded rows: MIRROR_TOKENS (or
    `TQSTORE_MIRROR_TOKENS`; 0 turns mirrors off) on CUDA, 0 elsewhere (on the CPU the plain
    ops read the storage; on Metal the fused kernels were not measured against a mirror)."""
    if kernels.select_backend() != "cuda":
        return 0
    return int(os.environ.get(MIRROR_ENV, MIRROR_TOKENS))


class DecodedMirror:
    """One layer's rows [0, offset) decoded, in the model's dtype, kept across decode steps."""

    def __init__(self):
        self._buffers = TokenBuffers()
        self._rows = 0  # rows held
        self._stored = -1  # the cache's stored rows when they were decoded

    @property
    def arrays(self) -> dict[str, mx.array]:
        """The buffers (keys, values), with spare capacity past the rows held."""
        return self._buffers.arrays

    def appends(self, cache: Any, keys: mx.array, values: mx.array) -> bool:
        """Write `cache`'s next rows here, where its tail would take them, when this mirror holds
        exactly its rows and their dtype (then the rows are the tail's bit for bit, and the
        cache's tail takes them from here only when read); False: nothing written."""
        held = self._buffers.arrays
        if not (held and self._stored == cache.stored and self._rows == cache.offset
                and keys.dtype == held["keys"].dtype and values.dtype == held["values"].dtype):
            return False
        self._buffers.write(self._rows, {"keys": keys, "values": values})
        self._rows += keys.shape[2]
        return True

    def rows_between(self, start: int, end: int) -> dict[str, mx.array]:
        """The rows at positions [start, end) as held (raw tail rows, never decoded ones)."""
        return {n: a[:, :, start:end] for n, a in self._buffers.arrays.items()}

    def rows(self, cache: Any) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, offset, D] of `cache` (a TurboQuantKVCache, which drops its
        mirror when it trims) as its attention reads them. A step that only appended rows writes
        those rows; a change of the stored rows decodes them all again."""
        if self._stored != cache.stored:
            keys, values = cache.dequantized()
            self._buffers.clear()
            self._buffers.write(0, {"keys": keys.astype(cache.native_dtype),
                                    "values": values.astype(cache.native_dtype)})
            self._stored = cache.stored
        elif self._rows < cache.offset:
            new = cache.tail_rows(self._rows, cache.offset)
            self._buffers.write(self._rows, new)
        self._rows = cache.offset
        held = self._buffers.view(cache.offset)
        return held["keys"], held["values"]


def lends(caches: list[Any], was: list[tuple[Any, int, int]]) -> bool:
    """Whether a stack that held `was` ((cache, stored, offset) after its last step) may take
    this step's rows of `caches` alone (`TurboQuantKVCache.lend`): the same caches in the same
    order, none changed since, and none encoding a block with this row."""
    return len(caches) == len(was) and all(
        c is c0 and c.stored == stored and c.offset == offset and c.lendable()
        for c, (c0, stored, offset) in zip(caches, was))


class HeldRows:
    """What a decode batch's stack shares: the caches it holds (cache, stored, offset, as of its
    last step), lending them their rows, and settling them before it changes its buffers."""

    def __init__(self):
        self._held: list[tuple[Any, int, int]] = []

    def _index(self, cache: Any) -> int:
        return next(i for i, (c, _, _) in enumerate(self._held) if c is cache)

    def _settle(self) -> None:
        """Every held cache takes back the rows lent to it here."""
        for c, _, _ in self._held:
            c.settle_from(self)

    def _lend(self, caches: list[Any]) -> None:
        for c in caches:
            c.lend(self)
        self._held = [(c, c.stored, c.offset) for c in caches]


class DecodedStack(HeldRows):
    """One layer's short compressed rows of a decode step, their mirrors stacked along the batch
    axis and attended in one CUDA launch (`kernels.ragged_decode`, each row over its own
    length), kept across steps: a step in which no row changed otherwise writes the rows' new
    rows here with one scatter, their caches only counting them (`TurboQuantKVCache.lend`, as
    a raw decode batch's group holds its rows); anything else gives each cache its row and
    stacks their mirrors again."""

    def __init__(self):
        super().__init__()
        self._keys: mx.array | None = None
        self._values: mx.array | None = None

    @staticmethod
    def applies() -> bool:
        """Whether short compressed rows attend over decoded mirrors here (`mirror_tokens`)."""
        return mirror_tokens() > 0

    def attend(self, caches: list[Any], keys: mx.array, values: mx.array, queries: mx.array,
               scale: float) -> mx.array:
        """Attention of one query token per row (queries [G, Hq, 1, D]) over each row's cache
        (TurboQuantKVCache, each no longer than `mirror_tokens()` with this step's row) and this
        step's row (`keys`, `values` [G, H, 1, D]), which this call adds to the caches:
        [G, Hq, 1, D]."""
        if (self._keys is not None and keys.dtype == self._keys.dtype and values.dtype == self._values.dtype
                and lends(caches, self._held) and max(c.offset for c in caches) < self._keys.shape[2]):
            rows = mx.arange(len(caches))
            at = mx.array([c.offset for c in caches])
            self._keys[rows, :, at] = keys[:, :, 0, :]
            self._values[rows, :, at] = values[:, :, 0, :]
            self._lend(caches)
        else:
            self._settle()
            for i, c in enumerate(caches):
                c.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            if len(caches) == 1:
                self._held, self._keys, self._values = [], None, None
                return caches[0].attention(queries, scale)
            self._build(caches)
            self._held = [(c, c.stored, c.offset) for c in caches]
        width = max(c.offset for c in caches)
        lengths = mx.array([c.offset for c in caches])
        out = kernels.ragged_decode(queries, self._keys[:, :, :width], self._values[:, :, :width], lengths, scale)
        if out is None:  # (a shape the kernel declines: each row alone)
            out = mx.concatenate([c.attention(queries[i:i + 1], scale) for i, c in enumerate(caches)])
        return out

    def lent_rows(self, cache: Any, start: int, end: int) -> dict[str, mx.array]:
        """The rows at positions [start, end) of `cache`, lent to it here."""
        i = self._index(cache)
        return {"keys": self._keys[i:i + 1, :, start:end], "values": self._values[i:i + 1, :, start:end]}

    def _build(self, caches: list[Any]) -> None:
        rows = [c.mirrored_rows() for c in caches]
        step = TokenBuffers().step
        capacity = -(-(max(c.offset for c in caches) + 1) // step) * step

        def padded(a: mx.array) -> mx.array:
            return mx.pad(a, [(0, 0), (0, 0), (0, capacity - a.shape[2]), (0, 0)])

        self._keys = mx.concatenate([padded(k) for k, _ in rows])
        self._values = mx.concatenate([padded(v) for _, v in rows])
