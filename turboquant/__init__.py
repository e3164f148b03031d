"""TurboQuant KV-cache compression on MLX: codec, cache and attention over compressed storage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cache import TurboQuantKVCache
from .codebook import Codebook, lloyd_max_codebook
from .codec import NormMode, TurboCodec
from .schemes import SchemeSpec, parse_scheme
from .records import LayerRecord, Layout, Snapshot

if TYPE_CHECKING:
    from .integration import install_attention_dispatch, make_prompt_cache, restore, restore_as, snapshot

# The mlx-lm side (integration.py) imports mlx-lm and transformers (about a second): loaded on
# first use, so the codec and the store's byte paths start fast.
_LAZY = {"install_attention_dispatch", "make_prompt_cache", "restore", "restore_as", "snapshot"}

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
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
