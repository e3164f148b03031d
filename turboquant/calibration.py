"""Per-dimension key calibration, computed once from the prefill keys of a layer.

Keys of models like Qwen2.5 carry a few huge channels (a k_proj bias: |K| ~ 200 against a
median channel maximum of ~4). A per-row norm is then dominated by those channels and the
codebook drowns everything else. Three exact-for-attention transforms, each optional:

- centering (original basis): k - mu. q.mu is the same for every key of a query, so the
  softmax ignores it: scores are computed without it.
- channel scaling (original basis): k / s, with q * s on the query side (q.k = (q*s).(k/s)).
- rotated-basis scaling (mlx-swift-lm): the rotated unit coordinates are divided by r
  before quantization and the query is multiplied by r after rotation.

All arrays are per KV head ([H, D]) and are persisted with the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .rotation import Rotation

CALIBRATION_TOKENS = 256
MIN_ROWS = 32
FLAT_TOLERANCE = 0.1
ROTATED_CLIP = (0.25, 4.0)
CHANNEL_FLOOR = 1e-3


@dataclass(frozen=True)
class CalibrationConfig:
    """Which of the three transforms a scheme applies."""

    center: bool = True
    channel_scale: bool = True
    rotated_scale: bool = False

    @property
    def enabled(self) -> bool:
        return self.center or self.channel_scale or self.rotated_scale


@dataclass(frozen=True, eq=False)
class KeyCalibration:
    """Fitted calibration of one layer; any part may be absent."""

    shift: mx.array | None = None  # [H, D] original basis
    scale: mx.array | None = None  # [H, D] original basis
    rotated_scale: mx.array | None = None  # [H, D] rotated basis

    def arrays(self) -> dict[str, mx.array]:
        """The arrays a snapshot persists, by name."""
        return {k: v for k, v in (("shift", self.shift), ("scale", self.scale),
                                  ("rotated_scale", self.rotated_scale)) if v is not None}

    @classmethod
    def from_arrays(cls, arrays: dict[str, mx.array]) -> "KeyCalibration":
        unknown = set(arrays) - {"shift", "scale", "rotated_scale"}
        if unknown:
            raise ValueError(f"unknown calibration arrays: {sorted(unknown)}")
        return cls(**{k: v.astype(mx.float32) for k, v in arrays.items()})

    def keys_in(self, keys: mx.array) -> mx.array:
        """Original-basis transform of keys [B, H, T, D] before encoding (float32)."""
        k = keys.astype(mx.float32)
        if self.shift is not None:
            k = k - self.shift[:, None, :]
        if self.scale is not None:
            k = k / self.scale[:, None, :]
        return k

    def keys_out(self, keys: mx.array) -> mx.array:
        """Inverse of `keys_in` (for dequantized views such as exports)."""
        if self.scale is not None:
            keys = keys * self.scale[:, None, :]
        if self.shift is not None:
            keys = keys + self.shift[:, None, :]
        return keys

    def codec_scale(self) -> mx.array | None:
        """Rotated-basis scale shaped to broadcast over [B, H, T, D], or None."""
        return None if self.rotated_scale is None else self.rotated_scale[:, None, :]

    def query_in(self, queries: mx.array) -> mx.array:
        """Original-basis query transform; queries grouped by KV head: [B, H, rows, D]."""
        return queries if self.scale is None else queries * self.scale[:, None, :]


def fit_key_calibration(keys: mx.array, rotation: Rotation, config: CalibrationConfig) -> KeyCalibration | None:
    """Fit the calibration of one layer from its prefill keys [B, H, T, D].

    Uses the first CALIBRATION_TOKENS tokens only, so the result depends on the first storage
    block alone. Returns None when disabled, when there are fewer than MIN_ROWS rows per head,
    or when every part is already flat.
    """
    if not config.enabled:
        return None
    keys = keys[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    B, H, T, D = keys.shape
    if B * T < MIN_ROWS:
        return None
    rows = keys.transpose(1, 0, 2, 3).reshape(H, B * T, D)
    shift = mx.mean(rows, axis=1) if config.center else None
    centered = rows - shift[:, None, :] if shift is not None else rows
    scale = None
    if config.channel_scale:
        rms = mx.sqrt(mx.mean(centered * centered, axis=1))
        scale = mx.maximum(rms / mx.mean(rms, axis=-1, keepdims=True), CHANNEL_FLOOR)
        centered = centered / scale[:, None, :]
        if _flat(scale):
            scale = None
    rotated_scale = None
    if config.rotated_scale:
        norms = mx.sqrt(mx.sum(centered * centered, axis=-1, keepdims=True))
        u = rotation.forward(centered / mx.maximum(norms, 1e-8))
        sigma = mx.sqrt(mx.var(u, axis=1))
        rotated_scale = mx.clip(sigma / mx.mean(sigma, axis=-1, keepdims=True), *ROTATED_CLIP)
        if _flat(rotated_scale):
            rotated_scale = None
    if shift is None and scale is None and rotated_scale is None:
        return None
    result = KeyCalibration(shift=shift, scale=scale, rotated_scale=rotated_scale)
    mx.eval(*result.arrays().values())
    return result


def _flat(s: mx.array) -> bool:
    return bool(mx.max(mx.abs(s - 1.0)).item() < FLAT_TOLERANCE)
