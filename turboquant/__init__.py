"""TurboQuant KV-cache compression on MLX: codec, cache and attention over compressed storage.

This module is the package's face: everything tqstore (or any other user) needs, named here and
loaded on first use. Inside, `codec/` holds how rows become bytes (schemes, plans, codebooks,
rotations, calibration), `attention/` the attention over compressed storage and its kernels,
`cache/` the compressed caches, `adapter/` mlx-lm's side (a model's caches, snapshots and
restores of every layer kind), and `records.py` the plain data between them and a store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from turboquant.codec.schemes import SCHEMES, Format, SchemeSpec, parse_scheme
from turboquant.records import LayerRecord, Layout, Snapshot

if TYPE_CHECKING:
    from turboquant.adapter.checkpoints import StateCheckpoints, chunk_ends
    from turboquant.adapter.context import Context
    from turboquant.adapter.dispatch import AttentionHook, compressed_sdpa, install_attention_dispatch
    from turboquant.adapter.making import (codec_snapshot, compress_caches, make_prompt_cache, probe_kv_shapes,
                                           start_decoding)
    from turboquant.adapter.native import NATIVE_CLASSES, NotNative, compress_snapshot, native_caches, native_snapshot
    from turboquant.adapter.snapshots import held_tokens, restore, restore_as, snapshot
    from turboquant.adapter.windows import WINDOW_CLASSES, WINDOW_MODES, from_rows, is_window_record, settle, settle_all
    from turboquant.attention.kernels import ragged_decode, select_backend
    from turboquant.cache.compressed import TurboQuantKVCache
    from turboquant.cache.mirror import DecodedStack, mirror_tokens
    from turboquant.cache.rows import RowStack, stack_key
    from turboquant.codec.codebook import Codebook, lloyd_max_codebook
    from turboquant.codec.plan import plan_layer
    from turboquant.codec.turbo import NormMode, TurboCodec

# Loaded on first use, so the store's byte paths (and `tqstore ls`) start fast: the mlx-lm side
# (adapter/) imports mlx-lm and transformers (about a second), the codec scipy (a quarter of a
# second here, over a second on the H200's image). name -> (module, attribute)
_LAZY = {
    **{n: ("adapter.checkpoints", n) for n in ("StateCheckpoints", "chunk_ends")},
    "Context": ("adapter.context", "Context"),
    **{n: ("adapter.dispatch", n) for n in ("AttentionHook", "compressed_sdpa", "install_attention_dispatch")},
    **{n: ("adapter.making", n) for n in ("codec_snapshot", "compress_caches", "make_prompt_cache",
                                          "probe_kv_shapes", "start_decoding")},
    **{n: ("adapter.native", n) for n in ("NATIVE_CLASSES", "NotNative", "compress_snapshot", "native_caches",
                                          "native_snapshot")},
    **{n: ("adapter.snapshots", n) for n in ("held_tokens", "restore", "restore_as", "snapshot")},
    **{n: ("adapter.windows", n) for n in ("WINDOW_CLASSES", "WINDOW_MODES", "from_rows", "is_window_record",
                                           "settle", "settle_all")},
    **{n: ("attention.kernels", n) for n in ("ragged_decode", "select_backend")},
    "TurboQuantKVCache": ("cache.compressed", "TurboQuantKVCache"),
    **{n: ("cache.mirror", n) for n in ("DecodedStack", "mirror_tokens")},
    **{n: ("cache.rows", n) for n in ("RowStack", "stack_key")},
    **{n: ("codec.codebook", n) for n in ("Codebook", "lloyd_max_codebook")},
    "plan_layer": ("codec.plan", "plan_layer"),
    **{n: ("codec.turbo", n) for n in ("NormMode", "TurboCodec")},
}

__all__ = sorted(["SCHEMES", "Format", "LayerRecord", "Layout", "SchemeSpec", "Snapshot", "parse_scheme", *_LAZY])


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
