"""mlx-lm integration: per-layer caches for a model, the attention dispatch, snapshots.

mlx-lm is imported here (and in tqstore's engine and interop) only. Model modules bind
`scaled_dot_product_attention` at import time (`from .base import ...`), so the dispatch is
set on every loaded `mlx_lm.models.*` module, not on `base` alone; nothing in mlx-lm is
forked or edited. Never pass `kv_bits` to mlx-lm's generate functions with these caches.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from .buffers import detach
from .cache import CompressedKeys, TurboQuantKVCache
from .calibration import CalibrationConfig
from .plan import DEFAULT_CALIBRATION, DEFAULT_GUARD, plan_layer
from .schemes import Format, SchemeSpec, parse_scheme
from .records import LayerRecord, Layout, Snapshot

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_notices: set[str] = set()


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


def _notice_once(message: str) -> None:
    if message not in _notices:
        _notices.add(message)
        warnings.warn(message, stacklevel=3)


def probe_kv_shapes(model) -> list[tuple[int, int, int, mx.Dtype] | None]:
    """(kv heads, head dim K, head dim V, dtype) per layer from a one-token forward; None for non-KV layers."""
    caches = mlx_make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    shapes = []
    for c in caches:
        keys = getattr(c, "keys", None)
        if isinstance(c, (KVCache, RotatingKVCache)) and keys is not None:
            shapes.append((keys.shape[1], keys.shape[3], c.values.shape[3], keys.dtype))
        else:
            shapes.append(None)
    return shapes


def protected_layers(eligible: list[int], fragile: bool) -> set[int]:
    """Boundary protection: the first and last two eligible layers (one each below 8 eligible).

    Never more than half of the eligible layers, so at least half stay TurboQuant.
    """
    k = 2 if len(eligible) >= 8 else 1
    k = min(k, len(eligible) // 4)
    if not fragile or k == 0:
        return set()
    return set(eligible[:k]) | set(eligible[-k:])


PROTECTION_MODES = ("stats", "position", "none")


def make_prompt_cache(
    model,
    scheme: str | SchemeSpec = "turbo0v4",
    *,
    seed: int = 0,
    protect: str = "stats",
    calibration: CalibrationConfig = DEFAULT_CALIBRATION,
    guard: float = DEFAULT_GUARD,
) -> list[Any]:
    """One cache per layer as the scheme decides; honours `model.make_cache()` (sliding layers).

    Plain attention layers become TurboQuantKVCache (or stay mlx-lm KVCache where the layer
    stays native); sliding-window layers stay RotatingKVCache with a one-time notice.
    Protection of fragile schemes: "stats" lets each TurboQuant-key layer decide at compression
    from its prefill statistics whether to store affine8 instead (falling back to the boundary
    rule without observed queries); "position" makes the first and last two eligible layers
    affine8; "none" protects nothing.
    """
    if protect not in PROTECTION_MODES:
        raise ValueError(f"protect must be one of {PROTECTION_MODES}, got {protect!r}")
    spec = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    install_attention_dispatch()
    base = mlx_make_prompt_cache(model)
    if not spec.compressed:
        return base
    shapes = probe_kv_shapes(model)
    eligible = [i for i, c in enumerate(base) if type(c) is KVCache and shapes[i] is not None]
    boundary = protected_layers(eligible, spec.fragile)
    by_stats = protect == "stats" and spec.key_format is Format.TURBO
    static = boundary if protect == "position" or (protect == "stats" and not by_stats) else set()
    if any(isinstance(c, RotatingKVCache) for c in base):
        _notice_once("sliding-window (rotating) layers keep their native KV cache; only global layers are compressed")
    caches = []
    for i, c in enumerate(base):
        plan = None
        if i in eligible:
            heads, dk, dv, dtype = shapes[i]
            plan = plan_layer(spec, heads, dk, dv, dtype, seed=seed, protected=i in static,
                              calibration=calibration, guard=guard if by_stats else None, boundary=i in boundary)
        caches.append(TurboQuantKVCache(plan) if plan is not None else c)
    return caches


def _native_record(cache) -> LayerRecord:
    if isinstance(cache, RotatingKVCache):
        arrays = {} if cache.keys is None else {"keys": detach(cache.keys), "values": detach(cache.values)}
        config = {"class": "RotatingKVCache", "max_size": cache.max_size, "keep": cache.keep}
        return LayerRecord(Layout.ROTATING, cache.offset, arrays, config, {"idx": cache._idx})
    if type(cache) is KVCache:
        arrays = {}
        if cache.keys is not None:
            arrays = {"keys": cache.keys[:, :, :cache.offset], "values": cache.values[:, :, :cache.offset]}
        return LayerRecord(Layout.RAW, cache.offset, arrays, {"class": "KVCache"})
    raise TypeError(f"cannot snapshot a {type(cache).__name__}: supported are TurboQuantKVCache, KVCache "
                    "and RotatingKVCache")


def snapshot(caches: list[Any]) -> Snapshot:
    """Every layer as a record plus the codecs they use (arrays shared, not copied)."""
    layers, codecs = [], {}
    for cache in caches:
        if isinstance(cache, TurboQuantKVCache):
            layers.append(cache.to_record())
            codecs.update(cache.plan.codecs())
        else:
            layers.append(_native_record(cache))
    return Snapshot(layers=layers, codecs=codecs)


def _restore_native(record: LayerRecord):
    cls = record.config.get("class")
    if cls == "RotatingKVCache":
        cache = RotatingKVCache(max_size=int(record.config["max_size"]), keep=int(record.config["keep"]))
        if record.arrays:
            cache.keys, cache.values = detach(record.arrays["keys"]), detach(record.arrays["values"])
        cache.offset, cache._idx = record.offset, int(record.state["idx"])
        return cache
    if cls == "KVCache":
        cache = KVCache()
        if record.offset:
            cache.keys, cache.values = detach(record.arrays["keys"]), detach(record.arrays["values"])
            cache.offset = record.offset
        return cache
    raise ValueError(f"unknown cache class {cls!r} in snapshot")


def restore_as(snap: Snapshot, caches: list[Any]) -> list[Any]:
    """Load an uncompressed snapshot into fresh caches of another scheme (`make_prompt_cache`).

    Raw rows (and the queries observed in prefill) are taken over as if prefilled; nothing is
    compressed until the caller compresses or decodes. Used to evaluate many schemes from one
    prefill, and to compress an imported mlx-lm prompt cache.
    """
    install_attention_dispatch()
    if len(snap.layers) != len(caches):
        raise ValueError(f"snapshot has {len(snap.layers)} layers, the model has {len(caches)}")
    out = []
    for record, cache in zip(snap.layers, caches):
        if record.layout not in (Layout.RAW, Layout.ROTATING):
            raise ValueError(f"restore_as needs uncompressed layers, got {record.layout.value}")
        if isinstance(cache, TurboQuantKVCache):
            if record.layout is Layout.ROTATING:
                raise ValueError("a sliding-window layer cannot become a compressed one")
            out.append(TurboQuantKVCache.from_record(record, snap.codecs, plan=cache.plan))
        elif record.layout is Layout.ROTATING:
            out.append(_restore_native(record))
        else:
            if record.offset:
                cache.update_and_fetch(record.arrays["keys"], record.arrays["values"])
            out.append(cache)
    return out


def restore(snap: Snapshot) -> list[Any]:
    """Caches that decode exactly like the ones the snapshot was taken from (same backend)."""
    install_attention_dispatch()
    return [TurboQuantKVCache.from_record(r, snap.codecs) if r.config.get("class") == "TurboQuantKVCache"
            else _restore_native(r) for r in snap.layers]
