"""AtRestKVCache: a layer stored compressed and decoded into a native cache to run.

Some models read their cache arrays themselves instead of passing them to the attention
dispatch: MLA latents (deepseek_v3 and its relatives score the rope part and unembed the
latent by hand), gemma2's soft-capped scores, gemma3n's KV-shared layers. Handles to compressed
storage cannot run there, so such a layer keeps mlx-lm's KVCache in memory and is compressed
only where it rests: a snapshot holds the layer's TurboQuant/affine codes (the same layouts and
metadata as TurboQuantKVCache, config class "AtRestKVCache"), and restore decodes them into the
native arrays the model reads.

The codes are kept beside the native rows: a restored layer snapshots to exactly the record
it was restored from, and rows added later are encoded once, when the next snapshot is taken.
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.plan import LayerPlan
from turboquant.records import CodecRecord, LayerRecord, Layout

CLASS = "AtRestKVCache"


class AtRestKVCache(KVCache):
    """mlx-lm's KVCache whose snapshot is compressed under `plan` (see the module docstring)."""

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self._codes = TurboQuantKVCache(plan)  # rows [0, self._codes.offset) encoded

    @property
    def active(self) -> LayerPlan:
        """The plan the codes are stored under (the guard may have switched it to affine8)."""
        return self._codes.active

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self._codes.offset > self.offset:
            self._codes.trim(self._codes.offset - self.offset)
        return n

    def compress(self) -> None:
        """Encode the rows added since the last snapshot (the first call fits the calibration)."""
        if self.offset > self._codes.offset:
            done = self._codes.offset
            self._codes.extend(self.keys[:, :, done:self.offset], self.values[:, :, done:self.offset])

    def to_record(self) -> LayerRecord:
        """The layer's codes as a record (compressed first, so it always rests compressed)."""
        self.compress()
        record = self._codes.to_record()
        if record.layout is Layout.RAW:  # empty: nothing was encoded yet
            return LayerRecord(Layout.RAW, 0, {}, self.meta(), record.state, {})
        return LayerRecord(record.layout, record.offset, record.arrays, self.meta(), record.state, record.calibration)

    def meta(self) -> dict:
        return {**self.plan.meta(), "class": CLASS}

    @classmethod
    def from_record(cls, record: LayerRecord, codecs: dict[str, CodecRecord],
                    plan: LayerPlan | None = None) -> "AtRestKVCache":
        """Decode a record into native rows, keeping its codes. A RAW record (an uncompressed
        snapshot taken over into this plan, `restore_as`) is adopted as prefilled rows."""
        codes = TurboQuantKVCache.from_record(record, codecs, plan=plan if record.layout is Layout.RAW else None)
        cache = cls(codes.plan)
        if record.layout is Layout.RAW:
            if record.offset:
                cache.update_and_fetch(record.arrays["keys"], record.arrays["values"])
            return cache
        cache._codes = codes
        keys, values = codes.dequantized()
        dtype = codes.native_dtype
        cache.update_and_fetch(keys.astype(dtype), values.astype(dtype))
        return cache
