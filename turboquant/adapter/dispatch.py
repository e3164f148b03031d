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


class AttentionHook:
    """Points the attention of every loaded mlx_lm.models module that calls `original` at
    `replacement`. `install` is idempotent and scans sys.modules again only once it changed
    size (a module imported since): the server installs per request, and a scan of the few
    thousand modules of a large environment took 2-11 ms of the model thread on the H200's host."""

    def __init__(self, original, replacement):
        self.original, self.replacement = original, replacement
        self._scanned = -1  # sys.modules' size at the last scan

    def install(self) -> None:
        """Set the replacement on every loaded model module still calling the original."""
        if len(sys.modules) == self._scanned:
            return
        for name, module in list(sys.modules.items()):
            if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is self.original:
                module.scaled_dot_product_attention = self.replacement
        self._scanned = len(sys.modules)


_COMPRESSED_HOOK = AttentionHook(_ORIGINAL_SDPA, compressed_sdpa)


def install_attention_dispatch() -> None:
    """Point every loaded mlx_lm.models module's attention at `compressed_sdpa` (idempotent)."""
    _COMPRESSED_HOOK.install()
