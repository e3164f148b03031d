"""mlx-lm prompt-cache files (`save_prompt_cache`, `mlx_lm.cache_prompt`) <-> Snapshots.

mlx-lm 0.32.2 writes `tree_flatten([c.state for c in caches])` with the class names and an
encoding of scalars in the safetensors metadata, and rebuilds each layer with
`globals()[class].from_state(state)`. Export builds real mlx-lm cache objects and lets
`save_prompt_cache` write them (to memory, then atomically to the file), so the file is exactly
what mlx-lm itself writes, except that buffers are cut to the tokens held: `from_state` accepts
that and the caches grow again on the next update. Only layers mlx-lm has a class for can be
exported: RAW (KVCache), AFFINE with equal key and value settings, no calibration and no raw
tail (QuantizedKVCache) and ROTATING (RotatingKVCache). Layers compressed at rest (the model
reads their arrays itself) are exported decoded, as the KVCache they restore into.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import (ConcatenateKVCache, KVCache, QuantizedKVCache, RotatingKVCache, load_prompt_cache,
                                 save_prompt_cache)

from turboquant.affine import AffineCodec
from turboquant.at_rest import CLASS as AT_REST_CLASS
from turboquant.at_rest import AtRestKVCache
from turboquant.cache import TurboQuantKVCache
from turboquant.calibration import CalibrationConfig
from turboquant.integration import make_prompt_cache, restore_as, snapshot
from turboquant.plan import LayerPlan, SidePlan, plan_layer
from turboquant.schemes import Format, parse_scheme
from turboquant.records import LayerRecord, Layout, Snapshot
from turboquant.windows import WINDOW_CLASSES, from_rows

from tqstore.canonical import dtype_name
from tqstore.durable import write_file_atomic
from tqstore.errors import MalformedHeader, NotFound, UnsupportedCache

IMPORTABLE = ("KVCache", "ConcatenateKVCache", "QuantizedKVCache", "RotatingKVCache")


@dataclass(frozen=True, eq=False)
class PromptCacheFile:
    """An imported prompt-cache file: the snapshot and the file's user metadata (str -> str)."""

    snapshot: Snapshot
    metadata: dict[str, str]


def export_prompt_cache(path: str | os.PathLike, snapshot: Snapshot, metadata: dict[str, str] | None = None) -> None:
    """Write `snapshot` as a file that `mlx_lm.models.cache.load_prompt_cache` loads.

    Raises UnsupportedCache naming the first layer mlx-lm cannot represent (TurboQuant
    layouts, calibrated or mixed-setting affine layers).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"mlx-lm prompt-cache files end in .safetensors (mlx.load picks the format by it): {path}")
    caches = [_to_mlx(i, r, snapshot) for i, r in enumerate(snapshot.layers)]
    buf = io.BytesIO()
    save_prompt_cache(buf, caches, dict(metadata or {}))
    write_file_atomic(path, buf.getvalue())


def import_prompt_cache(path: str | os.PathLike, *, model=None, scheme: str | None = None,
                        **cache_options) -> PromptCacheFile:
    """Read a prompt-cache file written by mlx-lm into a Snapshot.

    With `scheme` (e.g. "turbo0v4") and the `model` the file was made with, the raw layers
    are compressed as `make_prompt_cache(model, scheme, **cache_options)` caches would
    compress them (see `compress_snapshot`).
    """
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no prompt-cache file at {path}")
    try:
        _, flat = mx.load(str(path), return_metadata=True)
        _, classes, _ = tree_unflatten(list(flat.items()))
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        raise MalformedHeader(f"{path} is not an mlx-lm prompt-cache file ({e}); write it with "
                              "mlx_lm.models.cache.save_prompt_cache or mlx_lm.cache_prompt") from None
    unknown = [(i, c) for i, c in enumerate(classes) if c not in IMPORTABLE]
    if unknown:
        i, c = unknown[0]
        raise UnsupportedCache(f"{path}: layer {i} is a {c}, which tqstore cannot import (it imports "
                               f"{', '.join(IMPORTABLE)})")
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        raise MalformedHeader(f"{path}: mlx-lm cannot read this prompt-cache file ({e})") from None
    snap = Snapshot(layers=[_from_mlx(c) for c in caches], codecs={})
    if scheme is not None:
        if model is None:
            raise ValueError("compressing an imported cache to a scheme needs the model it was made with: its "
                             "caches decide each layer's plan")
        snap = compress_snapshot(snap, model, scheme, **cache_options)
    return PromptCacheFile(snap, dict(metadata))


def compress_snapshot(snap: Snapshot, model, scheme: str, **cache_options) -> Snapshot:
    """An uncompressed snapshot compressed to `scheme`: restored into `make_prompt_cache(model,
    scheme)` caches as if prefilled, compressed, and snapshotted again.

    An mlx-lm file holds no queries, so query-aware calibration sees the keys alone.
    """
    try:
        caches = restore_as(snap, make_prompt_cache(model, scheme, **cache_options))
    except ValueError as e:
        raise UnsupportedCache(f"cannot compress this cache to {scheme}: {e} (only KVCache layers can be "
                               "compressed; a QuantizedKVCache is already quantized)") from None
    for cache in caches:
        if hasattr(cache, "compress"):
            cache.compress()
    return snapshot(caches)


def _to_mlx(i: int, r: LayerRecord, snap: Snapshot):
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
        cache = RotatingKVCache(max_size=int(r.config["max_size"]), keep=int(r.config["keep"]))
        if r.arrays:
            cache.keys, cache.values = r.arrays["keys"], r.arrays["values"]
        cache.offset, cache._idx = r.offset, int(r.state["idx"])
        return cache
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
            raise UnsupportedCache(f"layer {i} is affine with {why}; mlx-lm's QuantizedKVCache cannot hold it: "
                                   "export a snapshot taken with scheme raw or affine8")
        ((bits, group_size),) = settings
        cache = QuantizedKVCache(group_size=int(group_size), bits=int(bits))
        if r.arrays:
            cache.keys = tuple(r.arrays[f"keys_{s}"] for s in ("w", "scales", "biases"))
            cache.values = tuple(r.arrays[f"values_{s}"] for s in ("w", "scales", "biases"))
        cache.offset = r.offset
        return cache
    raise UnsupportedCache(f"layer {i} is {r.layout.value} (TurboQuant): mlx-lm has no cache class that reads it; "
                           "export a snapshot taken with scheme raw or affine8, or keep tqstore's own format")


def _from_mlx(cache) -> LayerRecord:
    if isinstance(cache, RotatingKVCache):
        arrays = {} if cache.keys is None else {"keys": cache.keys, "values": cache.values}
        return LayerRecord(Layout.ROTATING, cache.offset, arrays,
                           {"class": "RotatingKVCache", "max_size": cache.max_size, "keep": cache.keep},
                           {"idx": cache._idx})
    if isinstance(cache, (KVCache, ConcatenateKVCache)):
        arrays = {}
        if cache.keys is not None and cache.offset:
            arrays = {"keys": cache.keys[:, :, :cache.offset], "values": cache.values[:, :, :cache.offset]}
        return LayerRecord(Layout.RAW, cache.offset, arrays, {"class": "KVCache"})
    return _from_quantized(cache)


def _from_quantized(cache: QuantizedKVCache) -> LayerRecord:
    if cache.keys is None:
        raise UnsupportedCache("an empty QuantizedKVCache has no head dims or dtype to import; drop the layer's "
                               "cache or fill it first")
    bits, group_size = int(cache.bits), int(cache.group_size)
    try:
        affine = AffineCodec(bits, group_size)
    except ValueError as e:
        raise UnsupportedCache(f"QuantizedKVCache with bits={bits}, group_size={group_size}: {e}") from None
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
