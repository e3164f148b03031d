"""TurboQuantKVCache: a two-phase compressed KV cache for mlx-lm models.

Prefill (multi-token updates before the first decode step) stores raw rows in the model's
dtype and returns them, so mlx-lm's own fused attention runs and prefill costs nothing
extra. The first single-token update (or `compress()`) compresses the whole cache once,
fitting key calibration from the first 256 tokens; from then on every update is encoded
incrementally and `update_and_fetch` returns handles that the attention dispatch recognises,
so attention reads the compressed storage directly.

The class deliberately has no attribute named `bits`: mlx-lm would route it to its own
quantized attention.
"""

from __future__ import annotations

import mlx.core as mx

from .attention import MaskLike, causal_mask, compressed_attention
from .buffers import TokenBuffers
from .calibration import KeyCalibration, fit_key_calibration
from .plan import LayerPlan
from .schemes import Format
from .snapshot import LAYOUT_ARRAYS, CodecRecord, LayerRecord, Layout


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
        self.plan = plan
        self.offset = 0
        self.compressed = False
        self.calibration: KeyCalibration | None = None
        self._raw = TokenBuffers(self.step)
        self._store = TokenBuffers(self.step)
        self._key_side = None
        self._value_side = None

    @property
    def native_dtype(self) -> mx.Dtype:
        return getattr(mx, self.plan.dtype)

    @property
    def batch(self) -> int:
        buffers = self._store if self.compressed else self._raw
        return next(iter(buffers.arrays.values())).shape[0] if buffers.arrays else 1

    @property
    def layout(self) -> Layout:
        """Storage layout now (RAW until compressed)."""
        if not self.compressed:
            return Layout.RAW
        kf, vf = self.plan.key.format, self.plan.value.format
        if kf is Format.AFFINE and vf is Format.AFFINE:
            return Layout.AFFINE
        if vf is Format.TURBO and kf is Format.NATIVE:
            return Layout.RAWK_TURBO
        if vf is Format.TURBO and kf is Format.AFFINE:
            return Layout.AFFINEK_TURBO
        return Layout.CALIBRATED if self.calibration is not None else Layout.TURBO

    # -- mlx-lm cache protocol -------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new rows; return raw arrays in prefill, handles once compressed."""
        n = keys.shape[2]
        if not self.compressed and n > 1:
            self._raw.write(self.offset, {"keys": keys, "values": values})
            self.offset += n
            view = self._raw.view(self.offset)
            return view["keys"], view["values"]
        if not self.compressed:
            self.compress()
        encoded = {**self._key_side.encode(keys), **self._value_side.encode(values)}
        self._store.write(self.offset, encoded)
        self.offset += n
        return CompressedKeys(self, self.plan.head_dim_k), CompressedValues(self, self.plan.head_dim_v)

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
        if self.offset == 0:
            self._reset()
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> list[mx.array]:
        """The arrays holding this cache (what mlx-lm evaluates); see `snapshot` to persist."""
        buffers = self._store if self.compressed else self._raw
        arrays = list(buffers.arrays.values())
        return arrays + (list(self.calibration.arrays().values()) if self.calibration else [])

    @property
    def nbytes(self) -> int:
        """Bytes of the held tokens (offset-sliced, not the spare capacity)."""
        buffers = self._store if self.compressed else self._raw
        arrays = buffers.view(self.offset).values() if buffers.arrays else []
        calib = self.calibration.arrays().values() if self.calibration else []
        return sum(a.nbytes for a in arrays) + sum(a.nbytes for a in calib)

    # -- compression and attention ---------------------------------------------------------

    def compress(self) -> None:
        """Compress the raw prefill rows now (once); later rows are encoded as they arrive."""
        if self.compressed:
            return
        raw = self._raw.view(self.offset) if self._raw.arrays else {}
        if self.plan.calibrated and raw:
            self.calibration = fit_key_calibration(raw["keys"], self.plan.key.turbo.rotation, self.plan.calibration)
        self._build_sides()
        self.compressed = True
        self._raw.clear()
        if raw:
            self._store.write(0, {**self._key_side.encode(raw["keys"]), **self._value_side.encode(raw["values"])})
            mx.eval(*self._store.arrays.values())

    def _build_sides(self) -> None:
        self._key_side = self.plan.key.side("keys", self.calibration)
        self._value_side = self.plan.value.side("values")

    def attention(self, queries: mx.array, scale: float, mask: MaskLike = None) -> mx.array:
        """Attention of queries [B, Hq, L, D] over the compressed rows (activation dtype out)."""
        arrays = self._store.view(self.offset)
        return compressed_attention(queries, self._key_side, arrays, self._value_side, arrays, scale, mask)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Reconstructed K and V [B, H, T, D] (float32 for TurboQuant sides) for tests and exports."""
        if not self.compressed:
            view = self._raw.view(self.offset)
            return view["keys"], view["values"]
        arrays = self._store.view(self.offset)
        return self._key_side.decode(arrays), self._value_side.decode(arrays)

    def _reset(self) -> None:
        self.compressed = False
        self.calibration = None
        self._raw.clear()
        self._store.clear()
        self._key_side = self._value_side = None

    # -- snapshot ----------------------------------------------------------------------------

    def to_record(self) -> LayerRecord:
        """This layer as a LayerRecord (arrays sliced to offset; nothing copied)."""
        buffers = self._store if self.compressed else self._raw
        arrays = buffers.view(self.offset) if buffers.arrays else {}
        calibration = self.calibration.arrays() if self.calibration else {}
        return LayerRecord(self.layout, self.offset, arrays, self.plan.meta(), {}, calibration)

    @classmethod
    def from_record(cls, record: LayerRecord, codecs: dict[str, CodecRecord]) -> "TurboQuantKVCache":
        """Rebuild a layer from its record and the snapshot's codecs (nothing regenerated)."""
        cache = cls(LayerPlan.from_meta(record.config, codecs))
        expected = set(LAYOUT_ARRAYS[record.layout]) if record.offset else set()
        if set(record.arrays) != expected and record.offset:
            raise ValueError(f"a {record.layout.value} layer needs arrays {sorted(expected)}, "
                             f"got {sorted(record.arrays)}")
        cache.offset = record.offset
        if record.calibration:
            cache.calibration = KeyCalibration.from_arrays(record.calibration)
        if record.layout is not Layout.RAW:
            cache.compressed = True
            cache._build_sides()
            if record.layout is not cache.layout:
                raise ValueError(f"layer record says {record.layout.value} but its plan and calibration "
                                 f"make it {cache.layout.value}")
            cache._store.adopt(record.arrays)
        elif record.offset:
            cache._raw.adopt(record.arrays)
        return cache
