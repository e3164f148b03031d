"""A snapshot of a model's KV caches as plain data: per-layer records plus shared codec arrays.

A snapshot is what the storage layer persists and what `restore` rebuilds caches from; nothing
in it depends on a random generator or on the process that made it.

Array naming: every per-token array is named `<side><suffix>` (side = `keys` or `values`) and
has the token axis at position 2 ([B, H, T, ...]), so a record can be cut into token blocks
along one axis and joined back. Suffixes by side format: native `""`, affine `_w` / `_scales` /
`_biases`, TurboQuant `_packed` / `_norms`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import mlx.core as mx

TOKEN_AXIS = 2
Scalar = int | float | str | bool | None


class Layout(str, enum.Enum):
    """How one layer's arrays are stored (an explicit enum, never inferred from array counts)."""

    RAW = "raw"  # native K and V: raw scheme, native layers, or the prefill phase of any scheme
    RAWK_TURBO = "rawk-turbo"  # turbo0vN: native K, TurboQuant V
    AFFINEK_TURBO = "affinek-turbo"  # turbo8vN: 8-bit affine K, TurboQuant V
    TURBO = "turbo"  # TurboQuant K and V, calibration skipped (too few rows or flat keys)
    CALIBRATED = "calibrated"  # TurboQuant K with per-dimension calibration, TurboQuant V
    AFFINE = "affine"  # affine K and V (affine schemes and protected boundary layers)
    ROTATING = "rotating"  # sliding-window layer: mlx-lm RotatingKVCache ring buffers, native


SIDE_SUFFIXES = {"native": ("",), "affine": ("_w", "_scales", "_biases"), "turbo": ("_packed", "_norms")}

# The array names each layout holds (the array-name table of docs/format.md).
LAYOUT_ARRAYS: dict[Layout, tuple[str, ...]] = {
    Layout.RAW: ("keys", "values"),
    Layout.RAWK_TURBO: ("keys", "values_packed", "values_norms"),
    Layout.AFFINEK_TURBO: ("keys_w", "keys_scales", "keys_biases", "values_packed", "values_norms"),
    Layout.TURBO: ("keys_packed", "keys_norms", "values_packed", "values_norms"),
    Layout.CALIBRATED: ("keys_packed", "keys_norms", "values_packed", "values_norms"),
    Layout.AFFINE: ("keys_w", "keys_scales", "keys_biases", "values_w", "values_scales", "values_biases"),
    Layout.ROTATING: ("keys", "values"),
}


@dataclass(frozen=True, eq=False)
class CodecRecord:
    """A TurboQuant codec's persisted arrays (centroids, boundaries, rotation) and modes."""

    rotation_kind: str
    norm_mode: str
    arrays: dict[str, mx.array]  # centroids, boundaries, and signs and/or matrix


@dataclass(frozen=True, eq=False)
class LayerRecord:
    """One layer: its layout, token count, arrays and the scalars needed to rebuild it.

    `arrays` holds the per-token arrays sliced to `offset` (token axis 2), except for
    ROTATING layers, whose ring buffers are kept whole. `config` holds the data-independent
    scalars (cache class, formats, bits, codec names, group size, head dims, dtype, ...: what
    the codec identity hashes); `state` the data-dependent scalars beyond layout and offset
    (a ring buffer's write index). `calibration` holds per-layer key calibration arrays
    ([H, D]), fitted from the first 256 tokens.
    """

    layout: Layout
    offset: int
    arrays: dict[str, mx.array]
    config: dict[str, Scalar]
    state: dict[str, Scalar] = field(default_factory=dict)
    calibration: dict[str, mx.array] = field(default_factory=dict)

    @property
    def per_token(self) -> bool:
        """Whether the arrays can be cut along the token axis (not a ring buffer)."""
        return self.layout is not Layout.ROTATING

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(a.nbytes for a in self.calibration.values())


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Per-layer records and the codecs they reference by name (stored once per snapshot)."""

    layers: list[LayerRecord]
    codecs: dict[str, CodecRecord]

    @property
    def offset(self) -> int:
        """Tokens held (the largest layer offset; every layer agrees for a plain model)."""
        return max((r.offset for r in self.layers), default=0)

    @property
    def nbytes(self) -> int:
        codec_bytes = sum(a.nbytes for c in self.codecs.values() for a in c.arrays.values())
        return sum(r.nbytes for r in self.layers) + codec_bytes

    def arrays(self) -> list[mx.array]:
        """Every array, for mx.eval."""
        out = [a for r in self.layers for a in (*r.arrays.values(), *r.calibration.values())]
        return out + [a for c in self.codecs.values() for a in c.arrays.values()]
