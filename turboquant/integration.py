"""mlx-lm integration: per-layer caches for a model, the attention dispatch, snapshots.

mlx-lm is imported here (and in tqstore's engine and interop) only. Model modules bind
`scaled_dot_product_attention` at import time (`from .base import ...`), so the dispatch is
set on every loaded `mlx_lm.models.*` module, not on `base` alone; nothing in mlx-lm is
forked or edited. Never pass `kv_bits` to mlx-lm's generate functions with these caches.
"""

from __future__ import annotations

import importlib
import sys
import warnings
import weakref
from typing import Any, Mapping

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, ConcatenateKVCache, KVCache, QuantizedKVCache,
                                 RotatingKVCache)
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from .allocation import AllocationGroup
from .at_rest import CLASS as AT_REST_CLASS
from .at_rest import AtRestKVCache
from .buffers import detach
from .cache import CompressedKeys, TurboQuantKVCache
from .calibration import CalibrationConfig
from .plan import DEFAULT_CALIBRATION, DEFAULT_GUARD, plan_layer
from .schemes import Format, SchemeSpec, parse_scheme
from .verdicts import book_for
from .records import (FIELD_PLANS, SIDE_SUFFIXES, LayerRecord, Layout, Path, Snapshot, child_path, join_children,
                      split_children, state_at, state_boundary)
from .residence import NATIVE_KINDS, Residence, kind_name, layers_read_by_model, residence_of
from .windows import WINDOW_CLASSES, WINDOW_MODES, from_rows, window_config, window_record

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
    at_rest: bool = False,
) -> list[Any]:
    """One cache per layer as the scheme decides; honours `model.make_cache()` (sliding layers).

    Plain attention layers that attend through the dispatch become TurboQuantKVCache
    (compressed in memory); plain layers whose arrays the model code reads itself become
    AtRestKVCache (compressed in the store, native in memory; found by a probe); every other
    cache kind stays native (residence.py has the table). Each residence that is not "in
    memory" is stated once per family as a warning. The plan is checked once per model and
    options (prefill, compress, snapshot, restore, one decode step): a plan that fails it falls
    back, with a stated warning, to at-rest and then to native layers, so nothing is stored
    that cannot be restored and decoded.
    Protection of fragile schemes: "stats" lets each TurboQuant-key layer decide at compression
    from its prefill statistics whether to store affine8 instead (falling back to the boundary
    rule without observed queries); "position" makes the first and last two eligible layers
    affine8; "none" protects nothing. `at_rest` compresses every compressible layer at rest only
    (native attention in memory; for comparisons).
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
    read = frozenset(eligible) if at_rest else layers_read_by_model(model, eligible)
    options = dict(seed=seed, protect=protect, calibration=calibration, guard=guard)
    fallback = _checked_fallback(model, spec, options, eligible, read)
    if fallback == "native":
        eligible = []
    elif fallback == "at rest":
        read = frozenset(eligible)
    caches = _planned_caches(model, spec, base, shapes, eligible, read, options)
    _state_residences(model, spec, caches, read_by_model=not at_rest and fallback is None)
    return caches


def _planned_caches(model, spec: SchemeSpec, base: list[Any], shapes, eligible: list[int], read: frozenset[int],
                    options: dict) -> list[Any]:
    boundary = protected_layers(eligible, spec.fragile)
    protect = options["protect"]
    by_stats = protect == "stats" and spec.key_format is Format.TURBO
    static = boundary if protect == "position" or (protect == "stats" and not by_stats) else set()
    caches = []
    group = None if spec.budget is None else AllocationGroup(spec.budget)  # one budget for all layers
    for i, c in enumerate(base):
        plan = None
        if i in eligible:
            heads, dk, dv, dtype = shapes[i]
            plan = plan_layer(spec, heads, dk, dv, dtype, seed=options["seed"], protected=i in static,
                              calibration=options["calibration"], guard=options["guard"] if by_stats else None,
                              boundary=i in boundary, group=group)
        if plan is None:
            caches.append(c)
        else:
            caches.append(AtRestKVCache(plan) if i in read else TurboQuantKVCache(plan))
    return caches


# The check's prompt: long enough to fit key calibration (calibration.MIN_ROWS rows), token ids
# that every vocabulary has.
CHECK_TOKENS = 40
_checked: dict[tuple, tuple[weakref.ref, str | None]] = {}


def _checked_fallback(model, spec: SchemeSpec, options: dict, eligible: list[int], read: frozenset[int]) -> str | None:
    """None when the plan passes `check_plan`; else "at rest" or "native", the first fallback
    that passes (stated as a warning). Cached per model object, scheme, options and layers, and
    in the model's `verdicts` book where one is registered."""
    key = (id(model), spec.name, tuple(eligible), read, *sorted((k, repr(v)) for k, v in options.items()))
    hit = _checked.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    book = book_for(model)
    kept_key = f"plan:{key[1:]!r}"
    kept = book.get(kept_key) if book is not None else None
    if isinstance(kept, dict) and kept.get("fallback") in (None, "at rest", "native"):
        if kept.get("notice"):
            _notice_once(kept["notice"])
        _checked[key] = (weakref.ref(model), kept["fallback"])
        return kept["fallback"]
    family = family_name(model)
    result, notice = None, None
    for fallback, layers_read in ((None, read), ("at rest", frozenset(eligible)), ("native", None)):
        if fallback == "native":
            notice = (f"scheme {spec.name} does not work for family {family} ({error}): "
                      "every layer of it is stored uncompressed")
            result = fallback
            break
        try:
            check_plan(model, lambda: _planned_caches(model, spec, mlx_make_prompt_cache(model),
                                                      probe_kv_shapes(model), eligible, layers_read, options))
            result = fallback
            if fallback is not None:
                notice = (f"scheme {spec.name} cannot attend over compressed storage for family {family} "
                          f"({error}): its layers are compressed at rest only")
            break
        except Exception as e:  # any failure of the plan is a fallback, stated above
            error = f"{type(e).__name__}: {e}"
    if notice is not None:
        _notice_once(notice)
    _checked[key] = (weakref.ref(model), result)
    if book is not None:
        book.put(kept_key, {"fallback": result, "notice": notice})
    return result


def check_plan(model, make_caches) -> None:
    """Prefill, compress, snapshot, restore and decode one token through `make_caches()`;
    raises where any step fails, or where the restored caches do not snapshot to exactly what
    was saved."""
    caches = make_caches()
    model(mx.arange(1, CHECK_TOKENS + 1)[None], cache=caches)
    compress_caches(caches)
    snap = snapshot(caches)
    restored = restore(snap)
    again = snapshot(restored)
    for i, (a, b) in enumerate(zip(snap.layers, again.layers)):
        if a.layout is not b.layout or set(a.arrays) != set(b.arrays) or not all(
                mx.array_equal(a.arrays[n], b.arrays[n]).item() for n in a.arrays):
            raise ValueError(f"layer {i} does not restore to what was saved")
    logits = model(mx.array([[1]]), cache=restored)
    if not mx.all(mx.isfinite(logits)).item():
        raise ValueError("a decode step through the restored caches is not finite")


def family_name(model) -> str:
    """The model's mlx-lm family (model_type), for messages and the support table."""
    name = getattr(model, "model_type", None)
    return name if isinstance(name, str) else type(model).__module__.rsplit(".", 1)[-1]


def _state_residences(model, spec: SchemeSpec, caches: list[Any], read_by_model: bool) -> None:
    family = family_name(model)
    for kind in sorted({kind_name(c) for c in caches if residence_of(c) is Residence.NATIVE}):
        why = NATIVE_KINDS.get(kind, "no compressed layout for this kind")
        _notice_once(f"layer kind {kind} ({why}) of family {family} is stored uncompressed under {spec.name}")
    if read_by_model and any(residence_of(c) is Residence.AT_REST for c in caches):
        _notice_once(f"layer kind KVCache of family {family} is read by the model code: compressed at rest only")


def layer_residences(model, scheme: str | SchemeSpec) -> list[tuple[str, Residence]]:
    """(cache kind, residence) per layer under `scheme`: the support table's columns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_prompt_cache(model, scheme)
    return [(kind_name(c), residence_of(c)) for c in caches]


def compress_caches(caches: list[Any]) -> None:
    """Compress every compressible cache now (what `save` does before its snapshot)."""
    for cache in caches:
        if isinstance(cache, (TurboQuantKVCache, AtRestKVCache)):
            cache.compress()


_KV_CLASSES = {"KVCache": KVCache, "ConcatenateKVCache": ConcatenateKVCache}
_MODEL_MODULES = "mlx_lm.models."


def _own(a: mx.array) -> mx.array:
    """A distinct array object with `a`'s contents: caches write into their arrays in place."""
    return detach(a) if a.ndim >= 3 else mx.array(a)


def _native_record(cache, tokens: int | None, by_token: bool = False) -> LayerRecord:
    """The record of one of mlx-lm's cache objects (or a model module's own cache class);
    `by_token`: a window stored whole in an entry that keeps its windows by token."""
    kind = type(cache)
    if kind is RotatingKVCache:
        arrays = {} if cache.keys is None else {"keys": detach(cache.keys), "values": detach(cache.values)}
        return LayerRecord(Layout.ROTATING, cache.offset, arrays, window_config(cache, by_token), {"idx": cache._idx})
    if kind in _KV_CLASSES.values():
        arrays = {}
        if cache.keys is not None:
            arrays = {"keys": cache.keys[:, :, :cache.offset], "values": cache.values[:, :, :cache.offset]}
        return LayerRecord(Layout.RAW, cache.offset, arrays, {"class": kind.__name__})
    if kind is QuantizedKVCache:
        arrays = {}
        if cache.keys is not None:
            for side, parts in (("keys", cache.keys), ("values", cache.values)):
                arrays.update({f"{side}{suffix}": a[:, :, :cache.offset]
                               for suffix, a in zip(SIDE_SUFFIXES["affine"], parts)})
        config = {"class": "QuantizedKVCache", "group_size": cache.group_size, "bits": cache.bits}
        return LayerRecord(Layout.QUANTIZED, cache.offset, arrays, config)
    if kind is ChunkedKVCache:
        arrays = {}
        if cache.keys is not None:
            keys, values = cache.keys_and_values()
            arrays = {"keys": keys, "values": values}
        return LayerRecord(Layout.CHUNKED, cache.offset, arrays, window_config(cache, by_token),
                           {"start_position": cache.start_position})
    if kind is ArraysCache:
        return _state_record(cache, tokens, {})
    if kind is CacheList:
        return join_children([_native_record(c, tokens) for c in cache.caches], {"class": "CacheList"})
    if kind.__module__.startswith(_MODEL_MODULES):
        return _fields_record(cache)
    raise TypeError(f"cannot snapshot a {kind.__name__}: not one of mlx-lm's cache classes nor a model's own")


def _state_record(cache: ArraysCache, tokens: int | None, checkpoints: Mapping[int, list]) -> LayerRecord:
    if cache.left_padding is not None or cache.lengths is not None:
        raise ValueError("a batched ArraysCache (left padding or lengths set) cannot be stored")
    arrays = {f"state{j}": _own(a) for j, a in enumerate(cache.cache) if a is not None}
    for t, states in checkpoints.items() if arrays else ():
        arrays.update({f"state{j}@{t}": a for j, a in enumerate(states) if a is not None})
    offset = 0 if not arrays else tokens or 0
    return LayerRecord(Layout.STATE, offset, arrays, {"class": "ArraysCache", "size": len(cache.cache)})


def fields_class(cache) -> str | None:
    """`module:Class` of a model module's own cache class (None for any other cache)."""
    kind = type(cache)
    return f"{kind.__module__}:{kind.__qualname__}" if kind.__module__.startswith(_MODEL_MODULES) else None


def _fields_record(cache, by_token: bool = False, checkpoints: Mapping[int, tuple[dict, dict]] | None = None
                   ) -> LayerRecord:
    """A model's own cache class: its array attributes and scalars. `by_token` with a class of
    `FIELD_PLANS`: marked `rows` "token", with its fields at earlier block ends (`checkpoints`,
    {tokens: ({end field: array or None}, {grown field: rows})}) as `<field>@<t>` arrays and
    scalars, so that the store cuts it into blocks."""
    arrays, state = {}, {}
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            arrays[name] = _own(value)
        elif value is None or isinstance(value, (bool, int, float, str)):
            state[name] = value
        else:
            raise TypeError(f"cannot snapshot {type(cache).__name__}.{name}, a {type(value).__name__}")
    config = {"class": fields_class(cache)}
    if by_token and config["class"] in FIELD_PLANS:
        config["rows"] = "token"
        for t, (ends, grown) in (checkpoints or {}).items():
            arrays.update({f"{f}@{t}": a for f, a in ends.items() if a is not None})
            state.update({f"{f}@{t}": None for f, a in ends.items() if a is None} | {f"{f}@{t}": n for f, n in grown.items()})
    return LayerRecord(Layout.FIELDS, int(getattr(cache, "offset", 0)), arrays, config, state)


def held_tokens(caches) -> int:
    """The tokens a model's caches hold, from the layers that count them (CacheList children
    too); 0 when none does (a purely recurrent model: pass the count to `snapshot`)."""
    counts = [held_tokens(c.caches) if isinstance(c, CacheList) else c.offset for c in caches
              if isinstance(c, CacheList) or isinstance(getattr(c, "offset", None), int)]
    return max(counts, default=0)


def snapshot(caches: list[Any], *, tokens: int | None = None,
             checkpoints: Mapping[Path, Mapping[int, list]] | None = None,
             rows: Mapping[Path, tuple[mx.array, mx.array]] | None = None, windows: str = "whole") -> Snapshot:
    """Every layer as a record plus the codecs they use (arrays shared, not copied).

    Recurrent states (ArraysCache) count no tokens themselves: they take `tokens`, by default
    the other layers' token count. `checkpoints` adds recurrent states at earlier block
    boundaries ({layer: {tokens seen: the ArraysCache's arrays}}), so that a prefix of the
    entry can be restored (see `StateCheckpoints`). `rows` gives window layers (RotatingKVCache,
    ChunkedKVCache) every token's (keys, values) row from token 0 ({layer: rows}, from
    `WindowRows`): with `windows` "token" they are stored by token, as RAW records, instead of
    whole (a window without rows is then still whole, its config marked as the entry's).
    With "token", a CacheList's members are recorded the same way, each by its own kind (their
    paths (layer, member, ...) key `checkpoints` and `rows`), and its config is marked `rows`
    "token" too: the store cuts such a list into blocks member by member.
    """
    if windows not in WINDOW_MODES:
        raise ValueError(f"windows must be one of {WINDOW_MODES}, got {windows!r}")
    by_token = windows == "token"
    if tokens is None:
        tokens = held_tokens(caches)
    codecs: dict = {}

    def record(path: Path, cache) -> LayerRecord:
        if isinstance(cache, (TurboQuantKVCache, AtRestKVCache)):
            codecs.update(cache.plan.codecs())
            return cache.to_record()
        if type(cache) is ArraysCache:
            return _state_record(cache, tokens, (checkpoints or {}).get(path, {}))
        if by_token and rows and path in rows and type(cache) in WINDOW_CLASSES.values():
            return window_record(cache, *rows[path])
        if by_token and fields_class(cache) in FIELD_PLANS:
            return _fields_record(cache, True, (checkpoints or {}).get(path))
        if by_token and type(cache) is CacheList:
            return join_children([record(child_path(path, j), c) for j, c in enumerate(cache.caches)],
                                 {"class": "CacheList", "rows": "token"})
        return _native_record(cache, tokens, by_token)

    layers = [record(i, cache) for i, cache in enumerate(caches)]
    return Snapshot(layers=layers, codecs=codecs)


def _restore_native(record: LayerRecord):
    cls = record.config.get("class")
    if record.layout is Layout.RAW and cls in WINDOW_CLASSES:
        return from_rows(record)
    if record.layout is Layout.ROTATING:
        cache = RotatingKVCache(max_size=int(record.config["max_size"]), keep=int(record.config["keep"]))
        if record.arrays:
            cache.keys, cache.values = detach(record.arrays["keys"]), detach(record.arrays["values"])
        cache.offset, cache._idx = record.offset, int(record.state["idx"])
        return cache
    if record.layout is Layout.RAW and cls in _KV_CLASSES:
        cache = _KV_CLASSES[cls]()
        if record.offset:
            cache.keys, cache.values = detach(record.arrays["keys"]), detach(record.arrays["values"])
            cache.offset = record.offset
        return cache
    if record.layout is Layout.QUANTIZED:
        cache = QuantizedKVCache(group_size=int(record.config["group_size"]), bits=int(record.config["bits"]))
        if record.offset:
            cache.keys, cache.values = (tuple(detach(record.arrays[f"{side}{s}"]) for s in SIDE_SUFFIXES["affine"])
                                        for side in ("keys", "values"))
            cache.offset = record.offset
        return cache
    if record.layout is Layout.CHUNKED:
        cache = ChunkedKVCache(int(record.config["chunk_size"]))
        if record.arrays:
            cache.keys, cache.values = detach(record.arrays["keys"]), detach(record.arrays["values"])
        cache.offset, cache.start_position = record.offset, int(record.state["start_position"])
        return cache
    if record.layout is Layout.STATE:
        cache = ArraysCache(int(record.config["size"]))
        for name, a in state_at(record, record.offset).items():
            cache[state_boundary(name)[0]] = _own(a)
        return cache
    if record.layout is Layout.LIST:
        return CacheList(*(_restore_native(c) for c in split_children(record)))
    if record.layout is Layout.FIELDS:
        return _restore_fields(record)
    raise ValueError(f"unknown cache class {cls!r} in snapshot")


def _restore_fields(record: LayerRecord):
    module_name, _, qualname = str(record.config["class"]).partition(":")
    # Only classes of mlx-lm's model modules: a stored name must not pick arbitrary code.
    if not module_name.startswith(_MODEL_MODULES) or "." in qualname:
        raise ValueError(f"cache class {record.config['class']!r} is not a class of an mlx-lm model module")
    cls = getattr(importlib.import_module(module_name), qualname)
    cache = cls.__new__(cls)
    # `<field>@<t>`: the fields at an earlier block end (docs/format.md), not attributes.
    for name, value in record.state.items():
        if "@" not in name:
            setattr(cache, name, value)
    for name, a in record.arrays.items():
        if "@" not in name:
            setattr(cache, name, _own(a))
    return cache


PREFIX_KINDS = frozenset({"in memory", "at rest", "native", "window", "state", "list", "fields"})  # kinds a stored prefix can be cut from


def layer_kind(cache) -> tuple[str, str]:
    """(cache class, how the store keeps it) for one cache of `make_prompt_cache`: "in memory"
    (TurboQuant/affine in memory, on disk and in the bucket), "at rest" (compressed on disk and
    in the bucket, decoded into mlx-lm's KVCache in memory: the model reads the arrays itself),
    "native" (token rows as mlx-lm holds them), "window" (a sliding window or attention chunk:
    every token's row, native, the window rebuilt at any block end: `turboquant.windows`),
    "state" (recurrent state, stored at every block end), "list" (a CacheList whose members are
    each kept by their own kind), "fields" (a model's own cache class of `FIELD_PLANS`: its grown
    rows by block, its other fields at every block end) or "whole" (stored whole per entry: any
    other class of a model's own, and a list holding one). The first three are
    `residence.Residence`."""
    if isinstance(cache, TurboQuantKVCache):
        return "TurboQuantKVCache", Residence.IN_MEMORY.value
    if isinstance(cache, AtRestKVCache):
        return "AtRestKVCache", Residence.AT_REST.value
    name = type(cache).__name__
    if isinstance(cache, CacheList):
        kinds = [layer_kind(c) for c in cache.caches]
        return (f"CacheList({', '.join(name for name, _ in kinds)})",
                "list" if all(kind in PREFIX_KINDS for _, kind in kinds) else "whole")
    if type(cache) is ArraysCache:
        return f"ArraysCache({len(cache.cache)})", "state"
    if type(cache) in (*_KV_CLASSES.values(), QuantizedKVCache):
        return name, "native"
    if type(cache) in WINDOW_CLASSES.values():
        return name, "window"
    return name, "fields" if fields_class(cache) in FIELD_PLANS else "whole"


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
        if record.layout is Layout.RAW and isinstance(cache, TurboQuantKVCache):
            out.append(TurboQuantKVCache.from_record(record, snap.codecs, plan=cache.plan))
        elif record.layout is Layout.RAW and isinstance(cache, AtRestKVCache):
            out.append(AtRestKVCache.from_record(record, snap.codecs, plan=cache.plan))
        elif record.layout is Layout.RAW and type(cache) is KVCache:
            if record.offset:
                cache.update_and_fetch(record.arrays["keys"], record.arrays["values"])
            out.append(cache)
        elif isinstance(cache, (TurboQuantKVCache, AtRestKVCache)):
            raise ValueError(f"a {record.layout.value} layer cannot become a compressed one")
        elif record.layout in (Layout.AFFINE, Layout.TURBO, Layout.CALIBRATED, Layout.RAWK_TURBO,
                               Layout.AFFINEK_TURBO):
            raise ValueError(f"restore_as needs uncompressed layers, got {record.layout.value}")
        else:
            out.append(_restore_native(record))
    return out


def restore(snap: Snapshot) -> list[Any]:
    """Caches that decode exactly like the ones the snapshot was taken from (same backend)."""
    install_attention_dispatch()
    return [_restore_layer(r, snap.codecs) for r in snap.layers]


def _restore_layer(record: LayerRecord, codecs) -> Any:
    cls = record.config.get("class")
    if cls == "TurboQuantKVCache":
        return TurboQuantKVCache.from_record(record, codecs)
    if cls == AT_REST_CLASS:
        return AtRestKVCache.from_record(record, codecs)
    return _restore_native(record)
