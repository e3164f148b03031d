"""Affine (scale + bias per group) quantization of KV rows through mx.quantize.

The layout is MLX's own (QuantizedKVCache-compatible): uint32 words holding 32/bits codes,
and per-group scales and biases in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Preference order: 64 is mlx-lm's default; 96 = 3 * 32 needs 32; 128 only as a last resort.
GROUP_SIZES = (64, 32, 128)
AFFINE_BITS = (4, 8)


class UnsupportedHeadDim(ValueError):
    """No MLX affine group size divides the head dim (the cache keeps such a layer native)."""


def affine_group_size(d: int) -> int:
    """The first of 64, 32, 128 that divides `d`."""
    for g in GROUP_SIZES:
        if d % g == 0:
            return g
    raise UnsupportedHeadDim(
        f"head dim {d} fits no MLX affine group size (supported: {', '.join(map(str, GROUP_SIZES))}; "
        f"{d} % 32 = {d % 32}); such layers stay native"
    )


@dataclass(frozen=True)
class AffineCodec:
    """mx.quantize with fixed bits and group size."""

    bits: int
    group_size: int

    def __post_init__(self):
        if self.bits not in AFFINE_BITS:
            raise ValueError(f"affine quantization supports bits {AFFINE_BITS}, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"affine group size must be one of {GROUP_SIZES}, got {self.group_size}")

    @classmethod
    def for_dim(cls, d: int, bits: int) -> "AffineCodec":
        """Codec for head dim `d`; raises UnsupportedHeadDim when no group size fits."""
        return cls(bits=bits, group_size=affine_group_size(d))

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Rows [..., d] -> (words uint32, scales, biases) in x's dtype."""
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def decode(self, words: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        """Rows [..., d] in the scales' dtype."""
        return mx.dequantize(words, scales, biases, group_size=self.group_size, bits=self.bits)
