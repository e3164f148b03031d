"""TurboQuantKVCache: a two-phase compressed KV cache for mlx-lm models.

Prefill (multi-token updates before the first decode step) stores raw rows in the model's
dtype and returns them, so mlx-lm's own fused attention runs and prefill costs nothing extra.
The first single-token update (or `compress()`) compresses the whole cache once, fitting key
calibration from the first 256 tokens (and the queries seen there); from then on
`update_and_fetch` returns handles that the attention dispatch recognises, and attention reads
the compressed storage directly. A cache told to `defer` (tqstore's decoding, through
`start_decoding`, for a context shorter than a block) decodes raw until a block is held and
compresses then: storage is written block by block, so there is nothing to encode before, and
compressing a few rows cost a short request more than its decoding (issue 30: on an H100 the
compression of 8 fresh 16-token turbo4 requests took 160-235 ms, their 64 decode steps about
300).

Rows are compressed in blocks of 256 absolute positions. Calibrated keys store each block
minus its own mean (scores add q . mean back: exact). Rows added after compression collect raw
(the "tail", rows [stored, offset), attended exactly) and are encoded at the next update
after their block is full: a block that starts after compression with its own mean,
the rest of a block compressed earlier (left open by the prefill, a restore or `compress`) with
that block's mean. `compress()` compresses the tail too (what `save` does), so a snapshot after
it holds every row compressed.

The class deliberately has no attribute named `bits`: mlx-lm would route it to its own
quantized attention.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from turboquant.attention.compressed import MaskLike, causal_mask, compressed_attention
from turboquant.cache.buffers import TokenBuffers, detach
from turboquant.cache.mirror import DecodedMirror, mirror_tokens
from turboquant.codec.calibration import CALIBRATION_TOKENS, KeyCalibration, fitting, noise_gain
from turboquant.codec.plan import BASE_KEYS, LayerPlan
from turboquant.codec.schemes import Format
from turboquant.codec.stages import Stages, run
from turboquant.codec.sides import SHIFT_BLOCK, per_token_shifts
from turboquant.records import BLOCK_TOKENS, CodecRecord, LayerRecord, Layout, check_record_arrays

BLOCK = SHIFT_BLOCK
assert BLOCK == BLOCK_TOKENS, "key means are kept per storage block"


class CompressedKeys:
    """Stand-in for the keys array once compressed; carries the cache to the dispatch."""

    def __init__(self, cache: "TurboQuantKVCache", head_dim: int):
        self.cache = cache
        self.shape = (cache.batch, cache.plan.n_kv_heads, cache.offset, head_dim)
        self.dtype = cache.native_dtype


class CompressedValues(CompressedKeys):
    """Stand-in for the values array once compressed."""


class TurboQuantKVCache:
    """One layer's cache under a LayerPlan (mlx-lm cache protocol)."""

    step = 256

    def __init__(self, plan: LayerPlan):
        self.plan = plan  # as configured (what the codec identity hashes)
        self.active = plan  # as stored: plan.protected_plan() once the guard protects this layer
        self.offset = 0
        self.stored = 0  # rows [0, stored) are compressed; [stored, offset) are raw (the tail)
        self.compressed = False
        self.calibration: KeyCalibration | None = None
        self._store = TokenBuffers(self.step)
        self._tail_buffers = TokenBuffers(self.step)
        self._mirror_only = 0  # the newest rows, held by the mirror alone until the tail is read
        self._lent = 0  # the newest rows of all, held by `_lender` (a decode batch's stack) alone
        self._lender: Any = None
        self._shifts: mx.array | None = None  # [H, blocks, D] float32 block means of the keys
        self._query_power: mx.array | None = None  # sum of q^2 per (KV head, channel), first 256 positions
        self._query_rows = 0
        self._deferred = False  # decoding raw until a block is held (`defer`)
        self._key_side = None
        self._value_side = None
        self.allocated: str | None = None  # autoB layers: a plan.layout_options() entry, once decided
        self._steps: dict = {}  # the GPU decode step, prepared once and replayed (kernels/steps.py)
        self._mirror: DecodedMirror | None = None  # the rows decoded while the context is short (mirror.py)
        self.stack_memo: tuple[Any, Any] | None = None  # (active plan, key): rows.stack_key's, dropped on a reset
        if plan.group is not None:
            plan.group.join(self)

    @property
    def native_dtype(self) -> mx.Dtype:
        return getattr(mx, self.plan.dtype)

    @property
    def batch(self) -> int:
        # (the buffers as they are: settling the tail here would cost a decode step its writes)
        for arrays in (self._store.arrays, self._tail_buffers.arrays, self._mirror.arrays if self._mirror else {}):
            if arrays:
                return next(iter(arrays.values())).shape[0]
        return 1

    @property
    def _tail(self) -> TokenBuffers:
        """The raw rows [stored, offset), settled first (`_settle_tail`)."""
        self._settle_tail()
        return self._tail_buffers

    def _settle_tail(self) -> None:
        """Write into the tail the newest rows that only the decoded mirror holds, then those
        only a lender holds: while the mirror is current a decode step writes its row there
        alone, one write a step as a raw cache's (mirror.py); in a decode batch's stack the
        stack's one scatter is the only write (`lend`). Whatever reads the tail settles them first."""
        end = self.offset - self._lent
        if self._mirror_only:
            start, self._mirror_only = end - self._mirror_only, 0
            self._tail_buffers.write(start - self.stored, self._mirror.rows_between(start, end))
        if self._lent:
            rows = self._lender.lent_rows(self, end, self.offset)
            self._lent, self._lender = 0, None
            self._tail_buffers.write(end - self.stored, rows)

    def lendable(self) -> bool:
        """Whether this cache's next row may be held by a lender alone (`lend`): it is compressed
        and that row's update would encode nothing (no full block waits in the tail)."""
        return self.compressed and self.offset // BLOCK * BLOCK <= self.stored

    def defer(self) -> None:
        """Decode raw until a block is held, then compress (at the update that finds it held), where
        an uncompressed cache compresses at its first single-token update. For a context shorter
        than a block (`start_decoding`). Its decode steps' queries do not count towards the
        calibration, as they never did once a cache compressed at its first step."""
        self._deferred = True

    def dense_step(self, length: int, mirror: int | None = None) -> bool:
        """Whether a decode step at `length` rows (its offset, or the rows a decode batch holds
        for it) attends with MLX's SDPA over its rows held as arrays and its update encodes
        nothing: deferred under a block (every row raw), or over the decoded mirror (mirror.py:
        the stored rows decoded, every later row raw, as given). A decode batch may then hold
        those rows for it. `mirror`: `mirror_tokens()`, read here if not given (a caller asking
        every layer of several rows reads it once: it looks at the environment)."""
        if not self.compressed:
            return self._deferred and length < BLOCK
        mirror = mirror_tokens() if mirror is None else mirror
        return length + 1 <= mirror and length // BLOCK * BLOCK <= self.stored

    def lend(self, lender: Any) -> None:
        """Count one new row that `lender` holds (a decode batch's stack, which wrote it with the
        other rows' in one scatter) instead of writing it here: `lender.lent_rows(self, start,
        end)` gives such rows back when something reads the tail. Only while `lendable`; rows
        lent to another lender are settled first."""
        if self._lender is not None and self._lender is not lender:
            self._settle_tail()
        self._lender = lender
        self._lent += 1
        self.offset += 1

    def settle_from(self, lender: Any) -> None:
        """Take back the rows `lender` holds for this cache (before it changes its buffers)."""
        if self._lender is lender:
            self._settle_tail()

    def _drop_mirror(self) -> None:
        """Let go of the decoded mirror, its rows settled into the tail first."""
        self._settle_tail()
        self._mirror = None

    @property
    def centered(self) -> bool:
        return self.active.calibrated and self.active.calibration.center

    @property
    def guarded(self) -> bool:
        """Whether the statistics guard switched this layer to affine8."""
        return self.active.protected and self.active is not self.plan

    @property
    def layout(self) -> Layout:
        """Storage layout now (RAW until compressed)."""
        if not self.compressed:
            return Layout.RAW
        kf, vf = self.active.key.format, self.active.value.format
        if kf is Format.AFFINE and vf is Format.AFFINE:
            return Layout.AFFINE
        if kf is Format.NATIVE:
            return Layout.RAWK_TURBO
        if kf is Format.AFFINE:
            return Layout.AFFINEK_TURBO
        return Layout.CALIBRATED if self.calibration is not None or self._shifts is not None else Layout.TURBO

    # -- mlx-lm cache protocol -------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new rows; return raw arrays in prefill (and in decoding until a block is held),
        handles once compressed."""
        plan = self.plan
        if (keys.shape[1], keys.shape[3], values.shape[3]) != (plan.n_kv_heads, plan.head_dim_k, plan.head_dim_v):
            # A cache made for another model: some schemes ran on, recording the plan's shape
            # for rows of another one (a snapshot that restores wrong), others failed deep in MLX.
            raise ValueError(f"this cache was made for {plan.n_kv_heads} KV heads of head dim {plan.head_dim_k} "
                             f"(values {plan.head_dim_v}), got keys {tuple(keys.shape)} and values "
                             f"{tuple(values.shape)}: make the caches for this model (make_prompt_cache)")
        n = keys.shape[2]
        if not self.compressed and (n > 1 or self._deferred and self.offset < BLOCK):
            self._tail.write(self.offset, {"keys": keys, "values": values})
            self.offset += n
            view = self._tail.view(self.offset)
            return view["keys"], view["values"]
        if not self.compressed:
            self.compress()
        self._append(keys, values)
        return CompressedKeys(self, self.plan.head_dim_k), CompressedValues(self, self.plan.head_dim_v)

    def observe_queries(self, queries: mx.array, scale: float = 1.0) -> None:
        """Record the power of the (scaled) queries at positions < 256 (called by the attention
        dispatch in prefill, after `update_and_fetch`): it makes the key channel scales
        query-aware and lets the guard predict the damage quantization would do. A deferred
        cache's (`defer`) decode queries do not count: in a decode batch a short row's queries
        never reach its cache, so counting them would make its calibration depend on the batch."""
        if self.compressed or self._deferred or not self.plan.calibrated:
            return
        B, hq, L, D = queries.shape
        if D != self.plan.head_dim_k or hq % self.plan.n_kv_heads:
            # Not queries against these keys (MLA attends with projected latents of another
            # width): calibrate from the keys alone.
            return
        first = self.offset - L
        n = min(L, CALIBRATION_TOKENS - first)
        if n <= 0:
            return
        q = queries[:, :, :n].astype(mx.float32) * scale
        q = q.reshape(B, self.plan.n_kv_heads, hq // self.plan.n_kv_heads, n, D)
        power = mx.sum(q * q, axis=(0, 2, 3))
        self._query_power = power if self._query_power is None else self._query_power + power
        self._query_rows += B * (hq // self.plan.n_kv_heads) * n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Same masks as mlx-lm's KVCache."""
        if window_size is not None or (N > 1 and return_array):
            T = self.offset + N
            mask = causal_mask(N, T)
            if window_size is not None:
                mask = mask & (mx.arange(T)[None, :] > (T - N + mx.arange(N))[:, None] - window_size)
            return mask
        return None if N == 1 else "causal"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens; trimming to zero starts over (calibration included)."""
        n = min(self.offset, n)
        self.offset -= n
        lent = min(n, self._lent)  # (the newest rows go first)
        self._lent -= lent
        self._lender = self._lender if self._lent else None
        self._mirror_only = max(0, self._mirror_only - (n - lent))
        self._drop_mirror()
        if self.offset == 0:
            self._reset()
        elif self.offset < self.stored:
            self.stored = self.offset
            self._tail.clear()
            if self._shifts is not None:
                self._shifts = self._shifts[:, : -(-self.stored // BLOCK)]
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> list[mx.array]:
        """The arrays holding this cache (what mlx-lm evaluates); see `snapshot` to persist."""
        record = self.to_record()
        return [*record.arrays.values(), *record.calibration.values()]

    @property
    def nbytes(self) -> int:
        """Bytes of the held tokens (offset-sliced, not the spare capacity)."""
        return self.to_record().nbytes

    # -- compression -----------------------------------------------------------------------

    def compress(self) -> None:
        """Compress every raw row now: the prefill on first use, the tail afterwards (save)."""
        run(self.compressing())

    def compressing(self, piece: int | None = None) -> Stages[None]:
        """`compress` in stages (turboquant/codec/stages.py): it yields the arrays each of its
        decisions reads, so that `compress_caches` compresses every layer of a model with one
        evaluation per decision for all of them. With `piece` (a multiple of BLOCK) the rows
        are encoded `piece` at a time, one stage each, the rows not yet encoded held in the
        tail in between (a consistent cache at every stage): a server runs other requests'
        steps between them instead of waiting for a long prompt's whole encoding. Each block
        is encoded whole in one piece, with its mean, so the bytes are those of one encoding."""
        if piece is not None and (piece <= 0 or piece % BLOCK):
            raise ValueError(f"piece must be a positive multiple of {BLOCK} rows, got {piece}")
        if not self.compressed:
            raw = self._tail.view(self.offset) if self.offset else {}
            power = None if not self._query_rows else self._query_power / self._query_rows
            if self.plan.calibrated and raw:
                self.calibration = yield from self._fitting(self.plan, raw["keys"], power)
                if self.plan.guard is not None and (yield from self._guard_trips(raw["keys"], power)):
                    self.active = self.plan.protected_plan()
                    self.calibration = yield from self._fitting(self.active, raw["keys"], power)
                if self.plan.budget is not None:
                    if self.allocated is None and self.plan.group is not None:
                        self.plan.group.decide()  # every layer of the group at once (allocation.py)
                    self.allocated = self.allocated or BASE_KEYS
                    if self.allocated != BASE_KEYS:
                        self.active = self.plan.with_layout(self.allocated)
                        self.calibration = yield from self._fitting(self.active, raw["keys"], power)
            self._query_power, self._query_rows = None, 0
            self._key_side = self.active.key.side("keys", self.calibration)
            self._value_side = self.active.value.side("values")
            self.compressed = True
        while self.offset > self.stored:
            tail = self._tail.view(self.offset - self.stored)
            n = self.offset - self.stored
            if piece is not None and n > piece + (-self.stored % BLOCK):
                n = piece + (-self.stored % BLOCK)  # (a block left open before ends with the first piece)
                self._tail.adopt({k: v[:, :, n:] for k, v in tail.items()})
            else:
                self._tail.clear()
            self._encode(tail["keys"][:, :, :n], tail["values"][:, :, :n])
            yield [*self._store.arrays.values(), *([self._shifts] if self._shifts is not None else [])]

    def extend(self, keys: mx.array, values: mx.array) -> None:
        """Append rows and compress everything held now (the encoder behind at-rest layers)."""
        if self.compressed:
            self._append(keys, values)
        else:
            self._tail.write(self.offset, {"keys": keys, "values": values})
            self.offset += keys.shape[2]
        self.compress()

    def raw_keys(self) -> mx.array:
        """The raw keys held before compression [B, H, offset, D]."""
        return self._tail.view(self.offset)["keys"]

    def raw_values(self) -> mx.array:
        """The raw values held before compression [B, H, offset, D]."""
        return self._tail.view(self.offset)["values"]

    def query_power(self) -> mx.array | None:
        """Mean squared scaled query per (KV head, channel) observed in prefill, or None."""
        return None if not self._query_rows else self._query_power / self._query_rows

    @staticmethod
    def fit(plan: LayerPlan, keys: mx.array, power: mx.array | None) -> KeyCalibration | None:
        """The key calibration `plan` fits to `keys` (and the query power, when observed)."""
        return run(TurboQuantKVCache._fitting(plan, keys, power))

    @staticmethod
    def _fitting(plan: LayerPlan, keys: mx.array, power: mx.array | None) -> Stages[KeyCalibration | None]:
        """`fit` in stages (codec/stages.py)."""
        rotation = plan.key.turbo.rotation if plan.key.turbo is not None else None
        return fitting(keys, rotation, plan.calibration, power)

    def _guard_trips(self, keys: mx.array, power: mx.array | None) -> Stages[bool]:
        """Statistics-chosen protection; position-based when no queries were observed."""
        if power is None:
            return self.plan.boundary
        gain = mx.max(noise_gain(keys, self.calibration, power))
        yield [gain]
        return bool(gain.item() > self.plan.guard)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        """New rows go to the raw tail, after the rows of earlier updates up to the last block
        boundary are encoded.

        Rows that land in a block compressed earlier (one left open by the prefill, a restore or
        `compress`) wait in the tail too and are encoded once that block is full, with its mean:
        the same bytes as encoding each at once, but a decode step under about 1k tokens no
        longer pays an encode of its token per layer (issue 30: 0.11-0.15x raw's tokens/s on
        the H200). An update's own rows are never encoded by it, so a question or chunk finds
        all of its rows in the tail, as `fused_prefill` needs; the tail holds at most 255 rows
        before an update (256 after a decode step)."""
        boundary = self.offset // BLOCK * BLOCK
        if boundary > self.stored:
            full = boundary - self.stored
            tail = self._tail.view(self.offset - self.stored)
            self._tail.clear()
            if self.offset > boundary:
                self._tail.write(0, {k: v[:, :, full:] for k, v in tail.items()})
            self._encode(tail["keys"][:, :, :full], tail["values"][:, :, :full])
        if self._mirror is not None and self._mirror.appends(self, keys, values):
            self._mirror_only += keys.shape[2]
        else:
            self._tail.write(self.offset - self.stored, {"keys": keys, "values": values})
        self.offset += keys.shape[2]

    def _encode(self, keys: mx.array, values: mx.array) -> None:
        """Compress rows starting at position `stored` (block means for new blocks)."""
        n = keys.shape[2]
        shift = None
        if self.centered:
            self._extend_shifts(keys)
            shift = per_token_shifts(self._shifts, self.stored + n)[:, :, self.stored:]
        self._store.write(self.stored, {**self._key_side.encode(keys, shift), **self._value_side.encode(values)})
        self.stored += n

    def _extend_shifts(self, keys: mx.array) -> None:
        """Add the means of blocks that start at or after `stored` (earlier blocks keep theirs)."""
        have = 0 if self._shifts is None else self._shifts.shape[1]
        first_new = -(-self.stored // BLOCK)
        end = self.stored + keys.shape[2]
        blocks = -(-end // BLOCK) - first_new
        if blocks <= 0:
            return
        assert have == first_new, "block means must cover every compressed block"
        skip = first_new * BLOCK - self.stored
        rows = keys[:, :, skip:].astype(mx.float32)
        B, H, n, D = rows.shape
        padded = mx.pad(rows, [(0, 0), (0, 0), (0, blocks * BLOCK - n), (0, 0)])
        sums = mx.sum(padded.reshape(B, H, blocks, BLOCK, D), axis=(0, 3))
        counts = mx.minimum(n - mx.arange(blocks) * BLOCK, BLOCK).astype(mx.float32) * B
        means = sums / counts[None, :, None]
        self._shifts = means if self._shifts is None else mx.concatenate([self._shifts, means], axis=1)

    # -- attention ---------------------------------------------------------------------------

    def attention(self, queries: mx.array, scale: float, mask: MaskLike = None,
                  sinks: mx.array | None = None) -> mx.array:
        """Attention of queries [B, Hq, L, D] over the compressed rows and the raw tail; `sinks`
        ([Hq] logits) join the softmax normaliser (gpt-oss). While the context is short enough
        for a mirror (mirror.py), MLX's fused SDPA over the rows decoded."""
        if self.offset <= mirror_tokens() and queries.dtype == self.native_dtype:
            keys, values = self.mirrored_rows()
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        self._drop_mirror()
        # The buffers themselves with the counts of rows that count: the decode kernels read them in
        # place (the plain path slices them).
        arrays = self._store.arrays if self.stored else {}
        tail = None
        if self.offset > self.stored:
            tail = (self._tail.arrays["keys"], self._tail.arrays["values"])
        return compressed_attention(queries, self._key_side, self._value_side, arrays, scale, mask,
                                    self._shifts, tail, self.stored, self.offset - self.stored, sinks,
                                    memo=self._steps)

    def mirrored_rows(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, offset, D] as attention reads them, decoded into the model's
        dtype and kept across steps (mirror.py: while the context is short, on CUDA)."""
        self._mirror = self._mirror or DecodedMirror()
        return self._mirror.rows(self)

    def tail_rows(self, start: int, end: int) -> dict[str, mx.array]:
        """The raw tail's rows at positions [start, end) (stored <= start), by name."""
        return {n: a[:, :, start - self.stored:end - self.stored] for n, a in self._tail.arrays.items()}

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Reconstructed K and V [B, H, T, D] for tests and exports (float32 where decoded)."""
        parts_k, parts_v = [], []
        if self.compressed and self.stored:
            arrays = self._store.view(self.stored)
            parts_k.append(self._key_side.decode(arrays, self._shifts).astype(mx.float32))
            parts_v.append(self._value_side.decode(arrays).astype(mx.float32))
        if self.offset > self.stored:
            view = self._tail.view(self.offset - self.stored)
            parts_k.append(view["keys"])
            parts_v.append(view["values"])
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return (mx.concatenate([p.astype(mx.float32) for p in parts_k], axis=2),
                mx.concatenate([p.astype(mx.float32) for p in parts_v], axis=2))

    def _reset(self) -> None:
        self.__init__(self.plan)

    # -- snapshot ----------------------------------------------------------------------------

    def to_record(self) -> LayerRecord:
        """This layer as a LayerRecord (arrays sliced to what is held; nothing copied).

        Uncompressed: `keys`, `values` (tokens [0, offset)) plus the observed query power.
        Compressed: the layout's arrays (tokens [0, stored)), `tail_keys`/`tail_values`
        (tokens [stored, offset)) and `keys_shift` ([1, H, blocks, D], one row per block).
        """
        calibration = self.calibration.arrays() if self.calibration else {}
        state = {"stored": self.stored, "guarded": self.guarded}
        if self.compressed and self.allocated is not None:
            state["allocated"] = self.allocated
        if not self.compressed:
            arrays = self._tail.view(self.offset) if self.offset else {}
            if self._query_rows:
                calibration = {"query_power": self._query_power}
                state["query_rows"] = self._query_rows
            return LayerRecord(Layout.RAW, self.offset, arrays, self.plan.meta(), state, calibration)
        arrays = self._store.view(self.stored) if self.stored else {}
        if self.offset > self.stored:
            arrays.update({f"tail_{k}": v for k, v in self._tail.view(self.offset - self.stored).items()})
        if self._shifts is not None:
            arrays["keys_shift"] = self._shifts[None]
        return LayerRecord(self.layout, self.offset, arrays, self.plan.meta(), state, calibration)

    @classmethod
    def from_record(cls, record: LayerRecord, codecs: dict[str, CodecRecord],
                    plan: LayerPlan | None = None) -> "TurboQuantKVCache":
        """Rebuild a layer from its record and the snapshot's codecs (nothing regenerated).

        `plan` replaces the recorded one for an uncompressed (RAW) record: raw rows prefilled
        once can then be compressed under any scheme.
        """
        check_record_arrays(record)
        if plan is not None and record.layout is not Layout.RAW:
            raise ValueError("only an uncompressed layer can take another plan")
        cache = cls(plan or LayerPlan.from_meta(record.config, codecs))
        cache.offset = record.offset
        cache.stored = int(record.state.get("stored", 0))
        arrays = dict(record.arrays)
        if record.layout is Layout.RAW:
            if "query_power" in record.calibration:
                cache._query_power = record.calibration["query_power"]
                cache._query_rows = int(record.state["query_rows"])
            if record.offset:
                cache._tail.adopt(arrays)
            return cache
        if record.calibration:
            cache.calibration = KeyCalibration.from_arrays(record.calibration)
        if record.state.get("guarded"):
            cache.active = cache.plan.protected_plan()
        cache.allocated = record.state.get("allocated")
        if cache.allocated is not None:
            cache.active = cache.plan.with_layout(str(cache.allocated), codecs)
        cache._key_side = cache.active.key.side("keys", cache.calibration)
        cache._value_side = cache.active.value.side("values")
        cache.compressed = True
        if "keys_shift" in arrays:
            cache._shifts = detach(arrays.pop("keys_shift"))[0]
        tail = {k[len("tail_"):]: arrays.pop(k) for k in list(arrays) if k.startswith("tail_")}
        if record.layout is not cache.layout:
            raise ValueError(f"layer record says {record.layout.value} but its plan and calibration "
                             f"make it {cache.layout.value}")
        if arrays:
            cache._store.adopt(arrays)
        if tail:
            cache._tail.adopt(tail)
        return cache
