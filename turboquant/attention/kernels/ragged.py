"""One-token attention over rows of their own lengths, in one CUDA launch: what a decode batch's
raw rows need when they differ in length (tqstore/engine/batch.py's group).

MLX 0.32.4's CUDA SDPA has a fused one-token kernel only without an array mask; with one it
falls back to separate matmul, mask and softmax ops. Measured on the H200 (8 rows, 32 query / 8
KV heads, d=128, bfloat16, 80 keys): 8 chained calls and a sync took 894 us with a bool mask
against 154 us without, so every decode step of rows of unequal length paid about 90 us per
layer. Metal's SDPA reads the mask in its fused kernel, so there the masked call stays.

`kernels.ragged_decode(queries, keys, values, lengths, scale)` launches it: softmax(q K^T * scale) V of each row's
one query token over that row's first `lengths[b]` keys, queries [B, Hq, 1, D], keys and values
[B, H, T, D] (read in place through their strides: a buffer's token slice costs no copy),
lengths int32 [B] (each at least 1). Scores, softmax and sums are float32; the output is in
the queries' dtype.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import mlx.core as mx

from turboquant.attention.kernels.dialects import SHORT, fill, section

LOG2E = 1 / math.log(2)
# Threadgroup memory for the warps' partial sums: NW * R * D floats within this budget.
SHARED_FLOATS = 8192
MAX_WARPS = 8
DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


@dataclass(frozen=True)
class Ragged:
    """The kernel for one model shape: head dim, KV heads, query heads per KV head, warps, the
    activations' dtype and the softmax scale (each its own build)."""

    D: int
    H: int
    R: int
    NW: int
    dtype: str
    scale: float

    @property
    def name(self) -> str:
        scale = struct.pack(">d", self.scale).hex()
        return f"tq_ragged_d{self.D}_h{self.H}_r{self.R}_w{self.NW}_{SHORT[self.dtype]}_s{scale}"

    def input_names(self) -> list[str]:
        return ["q", "k", "v", "lens"]

    def output_names(self) -> list[str]:
        return ["out"]

    def input_types(self) -> dict[str, str]:
        return {"q": self.dtype, "k": self.dtype, "v": self.dtype, "lens": "int32"}

    def render(self, prologue: str) -> str:
        """The kernel body after the dialect's thread-index prologue."""
        return prologue + "\n" + fill(section("ragged.h", "body"), D=self.D, H=self.H, R=self.R, NW=self.NW,
                                      DL=-(-self.D // 32), OUT=self.dtype,
                                      SCALE=f"{self.scale * LOG2E!r}f")

    @property
    def threads(self) -> int:
        return 32 * self.NW


def variant(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> Ragged | None:
    """The kernel for these shapes, or None where it does not apply (more than one query token,
    mismatched head dims or dtypes, a head dim over 256, too many query heads per KV head)."""
    _, Hq, L, D = queries.shape
    H = keys.shape[1]
    dtype = DTYPE_NAMES.get(queries.dtype)
    if (L != 1 or dtype is None or keys.dtype != queries.dtype or values.dtype != queries.dtype
            or keys.shape[-1] != D or values.shape[-1] != D or D > 256 or H == 0 or Hq % H):
        return None
    R = Hq // H
    warps = min(MAX_WARPS, SHARED_FLOATS // (R * D))
    if warps < 1 or R * -(-D // 32) > 64:  # registers: a query and a sum per head and channel
        return None
    return Ragged(D, H, R, warps, dtype, float(scale))
