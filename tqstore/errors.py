"""Error types of tqstore. Every message says what is wrong and what to do about it.

The CLI maps each type to one line and exit code 1; the server maps them to HTTP statuses.
"""

from __future__ import annotations


class TqstoreError(Exception):
    """Base of every expected failure (never shown to users as a traceback)."""


class FormatError(TqstoreError):
    """Bytes that are not a valid tqstore object (treated as a miss by the store)."""


class BadMagic(FormatError):
    """The data does not start with the tqstore magic."""


class FormatVersionTooNew(FormatError):
    """The object was written by a newer tqstore."""


class UnsupportedFormatVersion(FormatError):
    """The object's format version is not one this tqstore reads."""


class TruncatedData(FormatError):
    """The object is shorter (or longer) than its frame says."""


class ChecksumMismatch(FormatError):
    """A digest over the object or one of its tensors does not match."""


class MalformedHeader(FormatError):
    """The header or tensor table cannot be parsed or is inconsistent."""


class UnsupportedCache(FormatError):
    """A cache class or layout that cannot be converted (mlx-lm prompt-cache interop)."""


class IdentityMismatch(TqstoreError):
    """A cache was made for another model, tokenizer, template, scheme or codec."""


class TokenMismatch(TqstoreError):
    """The tokens stored with an object are not the ones asked for."""


class CorruptBlock(TqstoreError):
    """A stored object failed verification in a tier (it is quarantined)."""


class StoreDamaged(TqstoreError):
    """A store file or record is damaged as a whole (a truncated data.mdb); the message says how
    to recover."""


class NotFound(TqstoreError):
    """No entry or object with that name or key."""


class BadInput(TqstoreError, ValueError):
    """A request that cannot be served as given (an empty document, a bad option value)."""


class InvalidName(TqstoreError):
    """An entry name outside [A-Za-z0-9][A-Za-z0-9._-]{0,127}."""


class ConflictError(TqstoreError):
    """A concurrent writer changed the object first (S3 412/409 on a manifest)."""


class DiskFull(TqstoreError):
    """No space left for the home folder (or below the free-disk guard)."""


class ConfigError(TqstoreError):
    """A bad configuration file, environment variable or flag."""


class RemoteError(TqstoreError):
    """The S3-compatible tier failed."""


class RemoteNotConfigured(RemoteError):
    """An operation needs S3 but none is configured."""


class RemoteUnreachable(RemoteError):
    """The S3 endpoint cannot be reached (after retries)."""


class RemoteAuthError(RemoteError):
    """The S3 endpoint refused the credentials or the bucket."""


class OverMemoryBudget(BadInput):
    """A request whose estimated peak memory is above the budget set for it; the message gives
    the estimate, the budget and what to do (refused before any of the work is done)."""
