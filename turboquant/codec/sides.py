"""One side (K or V) of a layer: how its rows are stored and how attention reads them.

Every side implements the same small protocol, so attention never special-cases a layout:
`encode` rows into named per-token arrays, `decode` them back (tests, exports), `scores` of
grouped queries against stored keys, and `mix` attention weights with stored values.
Queries arrive grouped by KV head, [B, H, rows, D] float32, already multiplied by the scale.

Calibrated key sides store each block of keys minus the block's mean (`shift`, one row per
token, [1, H, T, D]); their scores add q . mean back, so the shift changes the quantization
error and nothing else.
"""

from __future__ import annotations

import mlx.core as mx

from turboquant.codec.affine import AffineCodec
from turboquant.codec.calibration import KeyCalibration
from turboquant.codec.turbo import TurboCodec
from turboquant.codec.schemes import Format


SHIFT_BLOCK = 256


def _t(x: mx.array) -> mx.array:
    return x.swapaxes(-1, -2)


def per_token_shifts(shifts: mx.array, T: int) -> mx.array:
    """Block means [H, nblocks, D] -> one row per token [1, H, T, D]."""
    return mx.repeat(shifts, SHIFT_BLOCK, axis=1)[None, :, :T]


def shift_scores(q: mx.array, shifts: mx.array | None, T: int) -> mx.array | float:
    """q . mean of each token's block: [B, H, rows, T] (0 without shifts). `shifts`: [H, blocks, D]
    shared by the batch, or [B, H, blocks, D], each row its own."""
    if shifts is None:
        return 0.0
    per_block = q @ _t(shifts if shifts.ndim == 4 else shifts[None])
    return mx.repeat(per_block, SHIFT_BLOCK, axis=-1)[..., :T]


class NativeSide:
    """Rows kept in the dtype the model produced (never cast in storage)."""

    format = Format.NATIVE

    def __init__(self, name: str):
        self.name = name

    def encode(self, x: mx.array, shift: mx.array | None = None) -> dict[str, mx.array]:
        return {self.name: x}

    def decode(self, arrays: dict[str, mx.array], shifts: mx.array | None = None) -> mx.array:
        return arrays[self.name]

    def scores(self, arrays: dict[str, mx.array], q: mx.array, shifts: mx.array | None = None) -> mx.array:
        # Scores in float32: Qwen2.5-class f16 dot products overflow.
        return q @ _t(arrays[self.name].astype(mx.float32))

    def mix(self, arrays: dict[str, mx.array], p: mx.array) -> mx.array:
        return p @ arrays[self.name].astype(mx.float32)


class AffineSide:
    """MLX affine quantization (words, scales, biases), dequantized transiently for attention.

    Keys may carry an original-basis calibration (centering, channel scales): Qwen2.5's bias
    channels otherwise set every group's step size.
    """

    format = Format.AFFINE

    def __init__(self, name: str, codec: AffineCodec, calibration: KeyCalibration | None = None):
        self.name = name
        self.codec = codec
        self.calibration = calibration

    def _names(self) -> tuple[str, str, str]:
        return f"{self.name}_w", f"{self.name}_scales", f"{self.name}_biases"

    def encode(self, x: mx.array, shift: mx.array | None = None) -> dict[str, mx.array]:
        if shift is not None:
            x = (x.astype(mx.float32) - shift).astype(x.dtype)
        if self.calibration is not None:
            x = self.calibration.keys_in(x.astype(mx.float32)).astype(x.dtype)
        return dict(zip(self._names(), self.codec.encode(x)))

    def _stored(self, arrays: dict[str, mx.array]) -> mx.array:
        return self.codec.decode(*(arrays[n] for n in self._names()))

    def decode(self, arrays: dict[str, mx.array], shifts: mx.array | None = None) -> mx.array:
        x = self._stored(arrays)
        if self.calibration is not None:
            x = self.calibration.keys_out(x.astype(mx.float32))
        if shifts is not None:
            x = x.astype(mx.float32) + per_token_shifts(shifts, x.shape[2])
        return x

    def scores(self, arrays: dict[str, mx.array], q: mx.array, shifts: mx.array | None = None) -> mx.array:
        k = self._stored(arrays).astype(mx.float32)
        qc = q if self.calibration is None else self.calibration.query_in(q)
        return qc @ _t(k) + shift_scores(q, shifts, k.shape[2])

    def mix(self, arrays: dict[str, mx.array], p: mx.array) -> mx.array:
        return p @ self._stored(arrays).astype(mx.float32)


class TurboSide:
    """TurboQuant rows: packed codes and one norm per row; keys optionally calibrated.

    Attention never un-rotates keys: the query is rotated once and scored against codebook
    values; values are summed in the rotated basis and rotated back once per output row.
    """

    format = Format.TURBO

    def __init__(self, name: str, codec: TurboCodec, calibration: KeyCalibration | None = None,
                 norm_dtype: str | None = None):
        self.name = name
        self.codec = codec
        self.calibration = calibration
        # Norms are stored at this width (float32 when None); attention reads them as they are.
        self.norm_dtype = None if norm_dtype is None else getattr(mx, norm_dtype)

    def _names(self) -> tuple[str, str]:
        return f"{self.name}_packed", f"{self.name}_norms"

    def _scale(self) -> mx.array | None:
        return None if self.calibration is None else self.calibration.codec_scale()

    def encode(self, x: mx.array, shift: mx.array | None = None) -> dict[str, mx.array]:
        if shift is not None:
            x = x.astype(mx.float32) - shift
        if self.calibration is not None:
            x = self.calibration.keys_in(x.astype(mx.float32))
        packed, norms = self.codec.encode(x, scale=self._scale())
        if self.norm_dtype is not None:
            norms = norms.astype(self.norm_dtype)
        return dict(zip(self._names(), (packed, norms)))

    def decode(self, arrays: dict[str, mx.array], shifts: mx.array | None = None) -> mx.array:
        packed, norms = (arrays[n] for n in self._names())
        x = self.codec.decode(packed, norms, scale=self._scale())
        if self.calibration is not None:
            x = self.calibration.keys_out(x)
        return x if shifts is None else x + per_token_shifts(shifts, x.shape[2])

    def rotate_queries(self, q: mx.array) -> mx.array:
        """Grouped queries into the basis the stored codes live in."""
        if self.calibration is not None:
            q = self.calibration.query_in(q)
        q = self.codec.rotation.forward(q)
        scale = self._scale()
        return q if scale is None else q * scale

    def scores(self, arrays: dict[str, mx.array], q: mx.array, shifts: mx.array | None = None) -> mx.array:
        packed, norms = (arrays[n] for n in self._names())
        # The one transient expansion of this plain-ops path: codebook values of one layer.
        c = self.codec.centroid_values(packed)
        return (self.rotate_queries(q) @ _t(c)) * norms[:, :, None, :] + shift_scores(q, shifts, c.shape[2])

    def mix(self, arrays: dict[str, mx.array], p: mx.array) -> mx.array:
        packed, norms = (arrays[n] for n in self._names())
        return self.codec.rotation.inverse(p @ self.codec.decode_rotated(packed, norms))


Side = NativeSide | AffineSide | TurboSide
