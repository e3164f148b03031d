"""What the byte tiers (LMDB, S3) share: object keys, result records and the common protocol."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

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


class ByteTier(Protocol):
    """The object half of the interface both byte tiers implement (manifests differ: S3 has etags)."""

    def has_object(self, key: bytes) -> bool: ...
    def object_info(self, key: bytes) -> ObjectInfo | None: ...
    def get_object(self, key: bytes) -> bytes | None: ...
    def put_object(self, key: bytes, payload: bytes) -> bool: ...
    def put_objects(self, objects: Mapping[bytes, bytes]) -> PutCounts: ...
    def delete_objects(self, keys: Iterable[bytes]) -> int: ...
    def iter_object_keys(self) -> Iterator[bytes]: ...
