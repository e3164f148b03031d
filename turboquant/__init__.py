"""TurboQuant KV-cache compression on MLX: codec, cache and attention over compressed storage."""

from .cache import TurboQuantKVCache
from .codebook import Codebook, lloyd_max_codebook
from .codec import NormMode, TurboCodec
from .integration import install_attention_dispatch, make_prompt_cache, restore, snapshot
from .schemes import SchemeSpec, parse_scheme
from .snapshot import LayerRecord, Layout, Snapshot

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
    "snapshot",
]
