"""What the byte tiers (LMDB, S3) share: object keys and result records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

KEY_BYTES = 32  # object keys are sha256 digests computed by the caller


def check_key(key: object) -> bytes:
    """Return `key` as bytes if it is a 32-byte digest; ValueError otherwise (a caller bug)."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ValueError(f"object keys are {KEY_BYTES}-byte digests, got {key!r:.80}")
    return bytes(key)


@dataclass(frozen=True)
class ObjectInfo:
    """What a tier knows about one stored object, without reading its payload."""

    key: bytes
    size: int
    sha256: str  # hex digest of the payload, computed by the tier when the object was stored
    created: float  # Unix time
    last_used: float  # Unix time (S3: the object's Last-Modified)
    segment_count: int = 0  # LMDB only: payloads are split into fixed-size segments
    segment_size: int = 0


@dataclass(frozen=True)
class ManifestInfo:
    """A named manifest as listed by a tier."""

    name: str
    size: int
    last_used: float  # LMDB: last put or touch; S3: the object's Last-Modified (last push)


class PutCounts(NamedTuple):
    """Result of a batch put: objects written, and objects skipped because they already existed."""

    stored: int
    skipped: int
