"""The float64 reference of the fused decode for the kernel tests (the cache builders and the
float64 attention it uses stay in `turboquant.kernels.reference`, which bench/decode.py needs)."""

from __future__ import annotations

import mlx.core as mx

from turboquant.cache import TurboQuantKVCache
from turboquant.kernels.reference import attention64, dequantized


def reference(cache: TurboQuantKVCache, q: mx.array, scale: float, with_tail: bool = True,
              sinks: mx.array | None = None):
    """float64 (out, lse) over the stored rows (and the tail when `with_tail`), with `sinks`."""
    k, v = dequantized(cache)
    if not with_tail:
        k, v = k[:, :, : cache.stored], v[:, :, : cache.stored]
    return attention64(q, k, v, scale, sinks)
