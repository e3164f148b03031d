"""TurboQuant KV-cache compression on MLX: codec, cache and attention over compressed storage."""

from .codebook import Codebook, lloyd_max_codebook
from .codec import NormMode, TurboCodec
from .schemes import SchemeSpec, parse_scheme

__all__ = [
    "Codebook",
    "NormMode",
    "SchemeSpec",
    "TurboCodec",
    "lloyd_max_codebook",
    "parse_scheme",
]
