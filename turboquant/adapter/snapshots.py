"""Snapshots of a model's caches as plain records, and caches restored from them, for every layer
kind mlx-lm has (native, compressed, at rest, windows, recurrent states, lists, a model's own)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from turboquant.adapter.dispatch import install_attention_dispatch
from turboquant.adapter.residence import Residence
from turboquant.adapter.windows import (
    WINDOW_CLASSES,
    WINDOW_MODES,
    from_rows,
    window_config,
    window_record,
)
from turboquant.cache.allocation import AllocationGroup
from turboquant.cache.at_rest import CLASS as AT_REST_CLASS
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.buffers import detach
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.records import (
    FIELD_PLANS,
    SIDE_SUFFIXES,
    LayerRecord,
    Layout,
    Path,
    Snapshot,
    child_path,
    join_children,
    split_children,
    state_at,
    state_boundary,
)

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
        keys, values, offset, _, _, idx = cache.state  # mlx-lm's own state holds the ring index
        arrays = {} if keys is None else {"keys": detach(keys), "values": detach(values)}
        return LayerRecord(Layout.ROTATING, offset, arrays, window_config(cache, by_token), {"idx": idx})
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
        *_, offset, _, start_position = cache.state
        return LayerRecord(Layout.CHUNKED, offset, arrays, window_config(cache, by_token),
                           {"start_position": start_position})
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
        keys, values = ((detach(record.arrays["keys"]), detach(record.arrays["values"])) if record.arrays
                        else (None, None))
        return RotatingKVCache.from_state((keys, values, record.offset, int(record.config["keep"]),
                                           int(record.config["max_size"]), int(record.state["idx"])))
    # mlx-lm's classes rebuilt from their own `state` (what its prompt-cache files hold too)
    if record.layout is Layout.RAW and cls in _KV_CLASSES:
        if not record.offset:
            return _KV_CLASSES[cls]()
        keys, values = detach(record.arrays["keys"]), detach(record.arrays["values"])
        return _KV_CLASSES[cls].from_state((keys, values, record.offset) if cls == "KVCache" else (keys, values))
    if record.layout is Layout.QUANTIZED:
        keys, values = ((tuple(detach(record.arrays[f"{side}{s}"]) for s in SIDE_SUFFIXES["affine"])
                         for side in ("keys", "values")) if record.offset else (None, None))
        return QuantizedKVCache.from_state((keys, values, record.offset, int(record.config["group_size"]),
                                            int(record.config["bits"])))
    if record.layout is Layout.CHUNKED:
        keys, values = ((detach(record.arrays["keys"]), detach(record.arrays["values"])) if record.arrays
                        else (None, None))
        return ChunkedKVCache.from_state((keys, values, record.offset, int(record.config["chunk_size"]),
                                          int(record.state["start_position"])))
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
    every token's row, native, the window rebuilt at any block end: `turboquant.adapter.windows`),
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
    caches = [_restore_layer(r, snap.codecs) for r in snap.layers]
    _regroup(caches)
    return caches


def _regroup(caches: list[Any]) -> None:
    """Join an auto scheme's layers restored before their allocation (taken before the first
    decode step) into one budget again, as make_prompt_cache made them: a plan's group is
    runtime only, and without it each layer fell back to the base layout at its compression, so
    the restored caches decoded otherwise than the ones the snapshot was taken from."""
    groups: dict[float, AllocationGroup] = {}
    for cache in caches:
        if isinstance(cache, TurboQuantKVCache) and cache.plan.budget is not None and not cache.compressed \
                and cache.allocated is None and cache.plan.group is None:
            group = groups.setdefault(cache.plan.budget, AllocationGroup(cache.plan.budget))
            cache.plan = dataclasses.replace(cache.plan, group=group)
            cache.active = cache.plan
            group.join(cache)


def _restore_layer(record: LayerRecord, codecs) -> Any:
    cls = record.config.get("class")
    if cls == "TurboQuantKVCache":
        return TurboQuantKVCache.from_record(record, codecs)
    if cls == AT_REST_CLASS:
        return AtRestKVCache.from_record(record, codecs)
    return _restore_native(record)
