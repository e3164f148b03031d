"""TurboQuant KV-cache compression on MLX: codec, cache and attention over compressed storage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .schemes import SchemeSpec, parse_scheme
from .records import LayerRecord, Layout, Snapshot

if TYPE_CHECKING:
    from .cache import TurboQuantKVCache
    from .codebook import Codebook, lloyd_max_codebook
    from .codec import NormMode, TurboCodec
    from .integration import install_attention_dispatch, make_prompt_cache, restore, restore_as, snapshot

# Loaded on first use, so the store's byte paths (and `tqstore ls`) start fast: the mlx-lm side
# (integration.py) imports mlx-lm and transformers (about a second), the codec scipy (a quarter
# of a second here, over a second on the H200's image).
_LAZY = {
    "TurboQuantKVCache": "cache", "Codebook": "codebook", "lloyd_max_codebook": "codebook", "NormMode": "codec",
    "TurboCodec": "codec", "install_attention_dispatch": "integration", "make_prompt_cache": "integration",
    "restore": "integration", "restore_as": "integration", "snapshot": "integration",
}

__all__ = [
    "Codebook",
    "LayerRecord",
    "Layout",
    "NormMode",
    "SchemeSpec",
    "Snapshot",
    "TurboCodec",
    "TurboQuantKVCache",
    "install_attention_dispatch",
    "lloyd_max_codebook",
    "make_prompt_cache",
    "parse_scheme",
    "restore",
    "restore_as",
    "snapshot",
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
