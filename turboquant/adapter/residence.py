"""Where each layer's cache lives compressed: in memory, at rest only, or nowhere (native).

The capability table per mlx-lm cache kind:

- KVCache whose arrays reach attention only through the dispatch: compressed **in memory**
  (TurboQuantKVCache; attention reads the codes, sinks included).
- KVCache whose arrays the model code reads itself (MLA latents, soft-capped scores, KV shared
  between layers): compressed **at rest** (AtRestKVCache: native in memory, codes in the store).
- every other kind (sliding-window and chunked rings, recurrent/conv ArraysCache, CacheList,
  mlx-lm's own quantized cache): **native**; recurrent states are small and not error-tolerant,
  rings are overwritten in place.

Which KVCache layers the model reads itself is found by a probe, not a list of families: a
short forward in which every candidate layer's cache hands out stand-ins for its arrays, as a
compressed cache does once it decodes. A layer whose stand-ins reach anything but the attention
dispatch (or whose arrays are asked for by another path, `keys_and_values`) is read by the
model.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from turboquant.adapter.verdicts import book_for
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import (
    CompressedKeys,
    CompressedValues,
    TurboQuantKVCache,
)


class Residence(str, enum.Enum):
    """Where a layer's cache is compressed (the support table's columns)."""

    IN_MEMORY = "in memory"
    AT_REST = "at rest"
    NATIVE = "native"


# Cache kinds stored natively, and why (the table above; the notices quote the reason).
NATIVE_KINDS = {
    "RotatingKVCache": "sliding window, overwritten in place",
    "ChunkedKVCache": "chunked attention window",
    "ArraysCache": "recurrent/conv state, small and not error-tolerant",
    "MambaCache": "recurrent/conv state, small and not error-tolerant",
    "CacheList": "composite cache",
    "QuantizedKVCache": "already quantized by mlx-lm",
    "ConcatenateKVCache": "concatenating cache",
    "KVCache": "no codec fits its head dims",
}


def residence_of(cache: Any) -> Residence:
    """The residence of one made cache (what `make_prompt_cache` chose for its layer)."""
    if isinstance(cache, TurboQuantKVCache):
        return Residence.IN_MEMORY
    if isinstance(cache, AtRestKVCache):
        return Residence.AT_REST
    return Residence.NATIVE


def kind_name(cache: Any) -> str:
    """The mlx-lm cache kind a layer was made as (what the support table lists)."""
    if isinstance(cache, (TurboQuantKVCache, AtRestKVCache)):
        return "KVCache"
    return type(cache).__name__


class _Touched(Exception):
    """A stand-in was used by model code (not the dispatch)."""

    def __init__(self, layer: int):
        super().__init__(f"layer {layer}'s cache arrays are read by the model code")
        self.layer = layer


class _StandIn:
    """Mixin of the probe's stand-ins: any use besides shape and dtype names the layer."""

    def __init__(self, cache: "_ProbeCache", array: mx.array):
        self.cache, self.shape, self.dtype = cache, array.shape, array.dtype

    def __getattr__(self, name: str):
        raise _Touched(self.cache.index)

    def _touched(self, *_):
        raise _Touched(self.cache.index)

    __matmul__ = __rmatmul__ = __mul__ = __rmul__ = __add__ = __radd__ = __sub__ = __rsub__ = _touched
    __truediv__ = __getitem__ = __array__ = __len__ = __iter__ = _touched


class _ProbeKeys(_StandIn, CompressedKeys):
    pass


class _ProbeValues(_StandIn, CompressedValues):
    pass


class _ProbeCache(KVCache):
    """A KVCache that hands out stand-ins once `handles` is set; the dispatch then calls
    `attention`, which attends over the real rows so the forward carries on."""

    current: "_ProbeCache | None" = None  # the layer that last stored rows (for untyped errors)

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.handles = False

    def update_and_fetch(self, keys, values):
        _ProbeCache.current = self
        handles, self.handles = self.handles, False  # KVCache.update_and_fetch ends in keys_and_values
        k, v = super().update_and_fetch(keys, values)
        self.handles = handles
        if not handles:
            return k, v
        return _ProbeKeys(self, k), _ProbeValues(self, v)

    def keys_and_values(self):
        if self.handles:
            raise _Touched(self.index)
        return super().keys_and_values()

    def attention(self, queries, scale, mask=None, sinks=None):
        k, v = super().keys_and_values()
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


_probed: dict[int, tuple[weakref.ref, frozenset[int]]] = {}


def layers_read_by_model(model, candidates: list[int]) -> frozenset[int]:
    """The candidate layers (plain KVCache) whose arrays the model code reads itself.

    Each failing forward names one layer, which is then probed native; the loop ends after at
    most len(candidates) + 1 short forwards (one for a model whose layers all use the dispatch).
    Cached per model object, and in the model's `verdicts` book where one is registered.
    """
    key = id(model)
    hit = _probed.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    book = book_for(model)
    kept_key = f"read-by-model:{sorted(candidates)}"
    kept = book.get(kept_key) if book is not None else None
    if kept is not None:
        result = frozenset(int(i) for i in kept)
        _probed[key] = (weakref.ref(model), result)
        return result
    read: set[int] = set()
    while True:
        caches = mlx_make_prompt_cache(model)
        probes = {i: _ProbeCache(i) for i in candidates if i not in read}
        caches = [probes.get(i, c) for i, c in enumerate(caches)]
        _ProbeCache.current = None
        try:
            mx.eval(model(mx.array([[1, 2, 3]]), cache=caches))
            for p in probes.values():
                p.handles = True
            mx.eval(model(mx.array([[4]]), cache=caches))  # a decode step
            mx.eval(model(mx.array([[5, 6]]), cache=caches))  # more tokens after a restore
            break
        except _Touched as e:
            read.add(e.layer)
        except Exception:
            last = _ProbeCache.current
            if last is None or last.index in read or not last.handles:
                raise
            read.add(last.index)
    result = frozenset(read)
    _probed[key] = (weakref.ref(model), result)
    if book is not None:
        book.put(kept_key, sorted(result))
    return result
