"""Byte-level storage tiers: LMDB on the SSD (`LmdbTier`) and S3-compatible buckets (`S3Tier`).

Both store opaque payloads under 32-byte keys plus small named manifests; docs/tiers.md
describes their layouts. Submodules are imported on first use, so opening the LMDB tier does
not pay for importing boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tqstore.store.tiers.base import ManifestInfo, ObjectInfo, PutCounts

if TYPE_CHECKING:
    from tqstore.store.tiers.lmdb import LmdbTier
    from tqstore.store.tiers.s3 import S3Tier

__all__ = ["LmdbTier", "ManifestInfo", "ObjectInfo", "PutCounts", "S3Tier"]


def __getattr__(name: str) -> object:
    if name == "LmdbTier":
        from tqstore.store.tiers.lmdb import LmdbTier

        return LmdbTier
    if name == "S3Tier":
        from tqstore.store.tiers.s3 import S3Tier

        return S3Tier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
