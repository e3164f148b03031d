"""Which format versions this tqstore reads: one check and one pair of messages for objects,
manifests and bundles, so a file from a newer tqstore always says "upgrade" and an old one says
how to make it again."""

from __future__ import annotations

from collections.abc import Set

from tqstore.errors import FormatVersionTooNew, UnsupportedFormatVersion


def check_version(version: int, readable: Set[int], what: str, remedy: str) -> None:
    """Raise unless `version` of `what` ("object", "manifest", "bundle x.tqb") is in `readable`;
    `remedy` is what to do with a version too old to read."""
    if version in readable:
        return
    known = ", ".join(map(str, sorted(readable)))
    if version > max(readable):
        raise FormatVersionTooNew(f"{what} was written by a newer tqstore (version {version}; this one reads "
                                  f"{known}): upgrade tqstore")
    raise UnsupportedFormatVersion(f"{what} has version {version}, which this tqstore no longer reads (it reads "
                                   f"{known}): {remedy}")
