"""The float64 reference of the fused decode for the kernel tests (the cache builders and the
float64 attention it uses stay in `kernel_support.synthetic`, which bench/decode.py needs)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from turboquant.attention.kernels import host
from turboquant.cache.compressed import TurboQuantKVCache
from kernel_support.synthetic import attention64, dequantized


def reference(cache: TurboQuantKVCache, q: mx.array, scale: float, with_tail: bool = True,
              sinks: mx.array | None = None):
    """float64 (out, lse) over the stored rows (and the tail when `with_tail`), with `sinks`."""
    k, v = dequantized(cache)
    if not with_tail:
        k, v = k[:, :, : cache.stored], v[:, :, : cache.stored]
    return attention64(q, k, v, scale, sinks)


def causal64(q: mx.array, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = True) -> np.ndarray:
    """float64 softmax(q K^T * scale) V for q [B, Hq, L, D] over k, v [B, H, T, D], query i at
    position T - L + i seeing the keys at or before it when `causal`."""
    qn = np.array(q.astype(mx.float32)).astype(np.float64)
    L, T = qn.shape[2], k.shape[2]
    R = qn.shape[1] // k.shape[1]
    k = np.repeat(k, R, axis=1)
    v = np.repeat(v, R, axis=1)
    s = qn @ k.swapaxes(-1, -2) * scale
    if causal:
        s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v



def from_scratch(make_kernel, q: mx.array, cache: TurboQuantKVCache, scale: float, causal: int = 0):
    """(out [B, Hq, L, D], lse) of the cache's attention for queries [B, Hq, L, D] through the
    kernels of `make_kernel`, built from scratch (`host.describe`, `host.launch`: no template or
    prepared step involved); `causal`: L > 1, the queries are the tail's last L rows."""
    B, Hq, L, D = q.shape
    rows_q = q.reshape(B, Hq * L, 1, D)
    tail = (cache._tail.arrays["keys"], cache._tail.arrays["values"])
    call = host.describe(rows_q, cache._key_side, cache._value_side, cache._store.arrays, cache._shifts,
                         tensor_cores=True, rows=cache.stored)
    out, lse = host.launch(make_kernel, call, rows_q, cache._key_side, cache._value_side, cache._store.arrays,
                           scale, cache._shifts, tail=tail, tail_rows=cache.offset - cache.stored, out_dtype=q.dtype,
                           causal=causal)
    return out.reshape(q.shape), lse
