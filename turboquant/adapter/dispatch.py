"""mlx-lm's attention pointed at compressed storage.

Model modules bind `scaled_dot_product_attention` at import time (`from .base import ...`), so
the dispatch is set on every loaded `mlx_lm.models.*` module, not on `base` alone; nothing in
mlx-lm is forked or edited. Never pass `kv_bits` to mlx-lm's generate functions with these
caches.
"""

from __future__ import annotations

import sys

from mlx_lm.models import base as mlx_base

from turboquant.cache.compressed import CompressedKeys, TurboQuantKVCache

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention


def compressed_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's scaled_dot_product_attention, reading TurboQuant storage when it is compressed."""
    if isinstance(keys, CompressedKeys):
        return keys.cache.attention(queries, scale, mask, sinks)
    if isinstance(cache, TurboQuantKVCache):
        cache.observe_queries(queries, scale)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_attention_dispatch() -> None:
    """Point every loaded mlx_lm.models module's attention at `compressed_sdpa` (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
            module.scaled_dot_product_attention = compressed_sdpa
