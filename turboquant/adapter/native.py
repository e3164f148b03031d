"""mlx-lm's own cache classes <-> layer records, for its prompt-cache files.

mlx-lm rebuilds each layer of a prompt-cache file with `from_state`; the caches built here are
exactly those classes, read and written through their own `state` where it holds everything
(RotatingKVCache's ring index is part of it). Only layers mlx-lm has a class for convert: RAW
(KVCache), AFFINE with equal key and value settings, no calibration and no raw tail
(QuantizedKVCache) and ROTATING (RotatingKVCache). Layers compressed at rest are converted
decoded, as the KVCache they restore into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from turboquant.adapter.making import make_prompt_cache
from turboquant.adapter.snapshots import restore_as, snapshot
from turboquant.adapter.windows import WINDOW_CLASSES, from_rows
from turboquant.cache.at_rest import CLASS as AT_REST_CLASS
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.affine import AffineCodec
from turboquant.codec.calibration import CALIBRATION_TOKENS, CalibrationConfig
from turboquant.codec.plan import LayerPlan, SidePlan, dtype_name, plan_layer
from turboquant.codec.schemes import Format, parse_scheme
from turboquant.records import LayerRecord, Layout, Snapshot

NATIVE_CLASSES = ("KVCache", "ConcatenateKVCache", "QuantizedKVCache", "RotatingKVCache")


class NotNative(ValueError):
    """A layer or cache that has no counterpart on the other side (the message says which and why)."""


def native_caches(snap: Snapshot) -> list:
    """mlx-lm cache objects holding `snap`'s layers. NotNative names the first layer mlx-lm
    cannot represent (TurboQuant layouts, calibrated or mixed-setting affine layers)."""
    return [_to_native(i, r, snap) for i, r in enumerate(snap.layers)]


def native_snapshot(caches: list) -> Snapshot:
    """The uncompressed snapshot of mlx-lm cache objects (of `NATIVE_CLASSES`)."""
    return Snapshot(layers=[_from_native(c) for c in caches], codecs={})


def compress_snapshot(snap: Snapshot, model, scheme: str, *, tokens: Sequence[int] | None = None,
                      **cache_options) -> Snapshot:
    """An uncompressed snapshot compressed to `scheme`: restored into `make_prompt_cache(model,
    scheme)` caches as if prefilled, compressed, and snapshotted again.

    An mlx-lm file holds no queries. Given the context's `tokens`, the model runs over the first
    CALIBRATION_TOKENS of them, the positions whose queries a prefill observes, so the keys'
    calibration and the guard see what they see in a prefill (a forward of at most 256 tokens);
    without, they see the keys alone (the guard then protects layers by position).
    """
    if tokens is not None and len(tokens) > 1:
        snap = _with_queries(snap, model, scheme, tokens, cache_options)
    try:
        caches = restore_as(snap, make_prompt_cache(model, scheme, **cache_options))
    except ValueError as e:
        raise NotNative(f"cannot compress this cache to {scheme}: {e} (only KVCache layers can be "
                               "compressed; a QuantizedKVCache is already quantized)") from None
    for cache in caches:
        if hasattr(cache, "compress"):
            cache.compress()
    return snapshot(caches)


def _with_queries(snap: Snapshot, model, scheme: str, tokens: Sequence[int], cache_options: dict) -> Snapshot:
    """`snap` whose raw layers carry the query power a prefill of `tokens` observes (as the
    uncompressed records of a prefill's caches do)."""
    probe = make_prompt_cache(model, scheme, **cache_options)
    model(mx.array(list(tokens[:CALIBRATION_TOKENS]))[None], cache=probe)
    layers = []
    for record, cache in zip(snap.layers, probe):
        observed = cache.to_record() if isinstance(cache, TurboQuantKVCache) else None
        if record.layout is Layout.RAW and observed is not None and "query_power" in observed.calibration:
            record = replace(record, calibration={**record.calibration, **observed.calibration},
                             state={**record.state, "query_rows": observed.state["query_rows"]})
        layers.append(record)
    return replace(snap, layers=layers)


def _to_native(i: int, r: LayerRecord, snap: Snapshot):
    if r.config.get("class") == AT_REST_CLASS:
        decoded = AtRestKVCache.from_record(r, snap.codecs)
        cache = KVCache()
        if decoded.offset:
            cache.keys, cache.values = decoded.keys_and_values()
            cache.offset = decoded.offset
        return cache
    if r.layout is Layout.RAW and r.config.get("class") in WINDOW_CLASSES:
        return from_rows(r)  # a window stored by token: the ring buffer or chunk a prefill holds
    if r.layout is Layout.RAW:
        cache = KVCache()
        if r.arrays:
            cache.keys, cache.values, cache.offset = r.arrays["keys"], r.arrays["values"], r.offset
        return cache
    if r.layout is Layout.ROTATING:
        keys, values = (r.arrays["keys"], r.arrays["values"]) if r.arrays else (None, None)
        return RotatingKVCache.from_state((keys, values, r.offset, int(r.config["keep"]), int(r.config["max_size"]),
                                           int(r.state["idx"])))
    if r.layout is Layout.AFFINE:
        c = r.config
        settings = {(c.get("key_bits"), c.get("key_group_size")), (c.get("value_bits"), c.get("value_group_size"))}
        why = None
        if r.calibration or "keys_shift" in r.arrays:
            why = "calibrated keys"
        elif len(settings) != 1:
            why = "different key and value bits or group sizes"
        elif "tail_keys" in r.arrays:
            why = f"{r.offset - int(r.state.get('stored', 0))} raw tail tokens (compress() the caches first)"
        if why:
            raise NotNative(f"layer {i} is affine with {why}; mlx-lm's QuantizedKVCache cannot hold it: "
                                   "export a snapshot taken with scheme raw or affine8")
        ((bits, group_size),) = settings
        cache = QuantizedKVCache(group_size=int(group_size), bits=int(bits))
        if r.arrays:
            cache.keys = tuple(r.arrays[f"keys_{s}"] for s in ("w", "scales", "biases"))
            cache.values = tuple(r.arrays[f"values_{s}"] for s in ("w", "scales", "biases"))
        cache.offset = r.offset
        return cache
    if r.layout in (Layout.STATE, Layout.LIST, Layout.FIELDS):
        raise NotNative(f"layer {i} is a {_KINDS[r.layout]}, which this export does not write for mlx-lm (it writes "
                        f"{', '.join(NATIVE_CLASSES)} layers); keep tqstore's own format")
    raise NotNative(f"layer {i} is {r.layout.value} (TurboQuant): mlx-lm has no cache class that reads it; "
                           "export a snapshot taken with scheme raw or affine8, or keep tqstore's own format")


_KINDS = {Layout.STATE: "recurrent state (ArraysCache)", Layout.LIST: "cache list (CacheList)",
          Layout.FIELDS: "model's own cache class"}


def _from_native(cache) -> LayerRecord:
    if isinstance(cache, RotatingKVCache):
        keys, values, offset, keep, max_size, idx = cache.state
        arrays = {} if keys is None else {"keys": keys, "values": values}
        return LayerRecord(Layout.ROTATING, offset, arrays,
                           {"class": "RotatingKVCache", "max_size": max_size, "keep": keep}, {"idx": idx})
    if isinstance(cache, (KVCache, ConcatenateKVCache)):
        arrays = {}
        if cache.keys is not None and cache.offset:
            arrays = {"keys": cache.keys[:, :, :cache.offset], "values": cache.values[:, :, :cache.offset]}
        return LayerRecord(Layout.RAW, cache.offset, arrays, {"class": "KVCache"})
    return _from_quantized(cache)


def _from_quantized(cache: QuantizedKVCache) -> LayerRecord:
    if cache.keys is None:
        raise NotNative("an empty QuantizedKVCache has no head dims or dtype to import; drop the layer's "
                               "cache or fill it first")
    bits, group_size = int(cache.bits), int(cache.group_size)
    try:
        affine = AffineCodec(bits, group_size)
    except ValueError as e:
        raise NotNative(f"QuantizedKVCache with bits={bits}, group_size={group_size}: {e}") from None
    kw, ks = cache.keys[0], cache.keys[1]
    dk, dv = kw.shape[-1] * 32 // bits, cache.values[0].shape[-1] * 32 // bits
    plan = plan_layer(parse_scheme(f"affine{bits}"), kw.shape[1], dk, dv, ks.dtype)
    if plan is None or plan.key.affine != affine or plan.value.affine != affine:
        side = SidePlan(Format.AFFINE, bits, affine=affine)
        plan = replace(plan, key=side, value=side) if plan is not None else LayerPlan(
            scheme=f"affine{bits}", key=side, value=side, n_kv_heads=kw.shape[1], head_dim_k=dk, head_dim_v=dv,
            dtype=dtype_name(ks.dtype), calibration=CalibrationConfig(False, False, False))
    n = cache.offset
    arrays = {f"{side_name}_{s}": a[:, :, :n] for side_name, triplet in (("keys", cache.keys), ("values", cache.values))
              for s, a in zip(("w", "scales", "biases"), triplet)}
    # Through TurboQuantKVCache, so the record carries the state fields the cache records today.
    return TurboQuantKVCache.from_record(LayerRecord(Layout.AFFINE, n, arrays, plan.meta(), {"stored": n}),
                                         {}).to_record()
