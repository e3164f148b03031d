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

from typing import Any

import mlx.core as mx

from turboquant.attention import kernels
from turboquant.cache.buffers import TokenBuffers
from turboquant.environment import setting

MIRROR_TOKENS = 1024
MIRROR_ENV = "TQSTORE_MIRROR_TOKENS"


def mirror_tokens() -> int:
    """Contexts up to this many tokens attend over decoded rows: MIRROR_TOKENS (or
    `TQSTORE_MIRROR_TOKENS`; 0 turns mirrors off) on CUDA, 0 elsewhere (on the CPU the plain
    ops read the storage; on Metal the fused kernels were not measured against a mirror)."""
    if kernels.select_backend() != "cuda":
        return 0
    value = setting(MIRROR_ENV)
    return MIRROR_TOKENS if value is None else int(value)


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
    """What a decode batch's stacks share: one buffer pair [rows, H, capacity, D] (`_buffers`)
    holding each cache's newest rows from `_origin(cache)` on, kept across steps, and the caches
    as of the last step (cache, stored, offset). A step in which no cache changed otherwise
    writes the new rows into the buffers with one scatter and lends them to the caches
    (`TurboQuantKVCache.lend`: they only count them); anything else gives each cache its row,
    after the caches took back what was lent here, and builds the buffers again (`_build`)."""

    def __init__(self):
        self._held: list[tuple[Any, int, int]] = []

    def _buffers(self) -> tuple[mx.array, mx.array] | None:
        raise NotImplementedError

    def _origin(self, cache: Any) -> int:
        """The position of the cache's first row in the buffers."""
        raise NotImplementedError

    def _build(self, caches: list[Any]) -> None:
        raise NotImplementedError

    def add_rows(self, caches: list[Any], keys: mx.array, values: mx.array) -> None:
        """Add this step's row of each cache (`keys`, `values` [G, H, 1, D])."""
        held = self._buffers()
        at = [c.offset - self._origin(c) for c in caches]
        if (held is not None and (keys.dtype, values.dtype) == (held[0].dtype, held[1].dtype)
                and lends(caches, self._held) and max(at) < held[0].shape[2]):
            rows, at = mx.arange(len(caches)), mx.array(at)
            held[0][rows, :, at] = keys[:, :, 0, :]
            held[1][rows, :, at] = values[:, :, 0, :]
            for c in caches:
                c.lend(self)
        else:
            for c, _, _ in self._held:  # before the buffers change
                c.settle_from(self)
            for i, c in enumerate(caches):
                c.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            self._build(caches)
        self._held = [(c, c.stored, c.offset) for c in caches]

    def lent_rows(self, cache: Any, start: int, end: int) -> dict[str, mx.array]:
        """The rows at positions [start, end) of `cache`, lent to it here."""
        i = next(i for i, (c, _, _) in enumerate(self._held) if c is cache)
        keys, values = self._buffers()
        a, b = start - self._origin(cache), end - self._origin(cache)
        return {"keys": keys[i:i + 1, :, a:b], "values": values[i:i + 1, :, a:b]}


class DecodedStack(HeldRows):
    """One layer's short compressed rows of a decode step, their mirrors stacked along the batch
    axis and attended in one CUDA launch (`kernels.ragged_decode`, each row over its own
    length), kept across steps (`HeldRows`)."""

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
        self.add_rows(caches, keys, values)
        width = max(c.offset for c in caches)
        lengths = mx.array([c.offset for c in caches])
        out = kernels.ragged_decode(queries, self._keys[:, :, :width], self._values[:, :, :width], lengths, scale)
        if out is None:  # (a shape the kernel declines: each row alone)
            out = mx.concatenate([c.attention(queries[i:i + 1], scale) for i, c in enumerate(caches)])
        return out

    def _buffers(self) -> tuple[mx.array, mx.array] | None:
        return None if self._keys is None else (self._keys, self._values)

    def _origin(self, cache: Any) -> int:
        return 0

    def _build(self, caches: list[Any]) -> None:
        rows = [c.mirrored_rows() for c in caches]
        step = TokenBuffers().step
        capacity = -(-(max(c.offset for c in caches) + 1) // step) * step

        def padded(a: mx.array) -> mx.array:
            return mx.pad(a, [(0, 0), (0, 0), (0, capacity - a.shape[2]), (0, 0)])

        self._keys = mx.concatenate([padded(k) for k, _ in rows])
        self._values = mx.concatenate([padded(v) for _, v in rows])
