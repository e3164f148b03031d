"""Fused single-token decode attention over compressed K/V on MLX's GPU backends.

`fused_decode(queries, key_side, value_side, arrays, scale, shifts, tail)` is what
`turboquant.attention.compressed_attention` calls for one query token (L == 1) without an array
mask. It returns `(out, lse)`:

- `out` [B, Hq, 1, D] float32: softmax(q K^T * scale) V over the stored rows and the raw `tail`
  (native K, V [B, H, n, D], the newest rows that do not fill a block yet), normalised, in the
  original basis (the inverse value rotation is applied);
- `lse` [B, Hq, 1] float32: the natural-log log-sum-exp of those rows' scaled scores.

It returns None, and the caller uses the plain-ops path, when no kernel applies: the CPU (or
any device other than the GPU), a GPU backend other than CUDA and Metal, L != 1, an unsupported
layout or shape (native values, head dims that are not a multiple of 8 in [8, 256], key and
value head dims that differ, more than 1024 * 4096 tokens), `TQSTORE_KERNELS=0`, or a Metal
kernel that failed its self-check.

Kernels per call: the query transform (pass 0), pass 1 over blocks of stored rows, pass 2
merging the blocks, un-rotating the values and, on CUDA, attending over the raw tail (Metal
merges the tail with plain ops, `merge_tail`); `template.py` explains them. On CUDA, fp16/bf16
activations over at least `host.MMA_MIN_TOKENS` stored rows run pass 1 on the tensor cores
(`mma.py`: fp16 products, float32 sums); otherwise scores, softmax and sums are float32 FMAs (no
TF32) and affine rows are dequantized unrounded (scale * code + bias in float32, as
mx.quantized_matmul does), which is more exact than the plain path's mx.dequantize into the
scale dtype.

Backends: CUDA (`cuda.py`, proven on an H200) when the default device is the GPU and
`mx.cuda.is_available()`; Metal (`metal.py`) when `mx.metal.is_available()`; both from one
template (`template.py`). Layouts: rawk-turbo (native K in f16/bf16/f32, TurboQuant V),
affinek-turbo (affine K, TurboQuant V), turbo and calibrated (TurboQuant K and V, per-block key
means), affine (affine K and V, 4 or 8 bits); TurboQuant bits 1-4; any GQA ratio (8 query rows
share one read of their KV head; larger ratios read it once per 8 rows).

`emulate.py` runs the very same kernel text on the CPU (one OS thread per GPU thread), which is
how the CPU tests check the kernels' logic; `reference.py` builds caches and the float64
reference for tests and the benchmark.
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import host
from .host import merge_tail

__all__ = ["fused_decode", "merge_tail", "select_backend"]


def select_backend() -> str | None:
    """"cuda", "metal" or None (plain ops) for the current default device."""
    if os.environ.get("TQSTORE_KERNELS", "1") == "0":
        return None
    try:
        if mx.default_device().type != mx.DeviceType.gpu:
            return None
        if mx.cuda.is_available():
            return "cuda"
        if mx.metal.is_available():
            return "metal"
    except (AttributeError, RuntimeError):
        return None
    return None


def fused_decode(queries: mx.array, key_side, value_side, arrays: dict[str, mx.array], scale: float,
                 shifts: mx.array | None = None,
                 tail: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array] | None:
    """(out, lse) of the stored rows and the raw `tail` through the GPU kernels, or None (see the
    module docstring)."""
    backend = select_backend()
    if backend is None:
        return None
    call = host.describe(queries, key_side, value_side, arrays, shifts, tensor_cores=backend == "cuda")
    if call is None:
        return None

    if backend == "cuda":
        from . import cuda

        return host.launch(cuda.kernel, call, queries, key_side, value_side, arrays, scale, shifts, tail=tail)
    from . import metal

    stored = metal.verdict(call, lambda: host.launch(metal.kernel, call, queries, key_side, value_side, arrays,
                                                     scale, shifts),
                           lambda: host.plain_decode(queries, key_side, value_side, arrays, scale, shifts))
    return None if stored is None else host.merge_tail(queries, *stored, tail, scale)
