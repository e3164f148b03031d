"""Per-dimension key calibration, fitted once from a layer's first 256 prefill tokens.

Keys of models like Qwen2.5 carry a few huge channels (a k_proj bias: |K| ~ 200 against a
median channel maximum of ~4), and after RoPE those biases rotate slowly with position. A
per-row norm is then dominated by them and the codebook drowns everything else. Three
transforms, each exact for attention:

- block centering: each 256-token block of keys is stored minus its own mean mu_b, and scores
  add q . mu_b back (the cache holds the per-block means; see cache.py).
- channel scaling (original basis): k / s, with q * s on the query side. s = sqrt(rms_k / rms_q)
  per channel minimises the expected squared score error for isotropic quantization noise
  (Cauchy-Schwarz); without observed queries, s = sqrt(rms_k).
- rotated-basis scaling (mlx-swift-lm): rotated unit coordinates divided by r before
  quantization, query multiplied by r after rotation.

Measured on Qwen2.5-Coder-0.5B (docs/quality.md): block centering and query-aware channel scales
are what bring symmetric 4-bit keys from collapse to the quality of per-channel 4-bit keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from turboquant.codec.rotation import Rotation
from turboquant.codec.stages import Stages, run
from turboquant.memo import once

CALIBRATION_TOKENS = 256
MIN_ROWS = 32
FLAT_TOLERANCE = 0.1
ROTATED_CLIP = (0.25, 4.0)
SCALE_CLIP = (1 / 64, 64.0)

# Calibrations made from persisted arrays, by the arrays' identities (checked on every hit). A
# restore from the memory tier hands out the same calibration arrays each time, so every restore
# gets the same calibration object, and the kernels' query tables made from it (the scale and
# rotated-scale tables of attention/kernels/host.py) are made once, not by each layer of each
# restore. Bounded: the calibrations of 512 layers ([H, D] float32 each) stay alive at most.
FROM_ARRAYS_KEPT = 512
_FROM_ARRAYS: dict[tuple, tuple[tuple, "KeyCalibration"]] = {}


@dataclass(frozen=True)
class CalibrationConfig:
    """Which of the three transforms a layer applies."""

    center: bool = True
    channel_scale: bool = True
    rotated_scale: bool = False

    @property
    def enabled(self) -> bool:
        return self.center or self.channel_scale or self.rotated_scale


@dataclass(frozen=True, eq=False)
class KeyCalibration:
    """Fitted per-layer scales ([H, D] float32); either may be absent."""

    scale: mx.array | None = None  # original basis
    rotated_scale: mx.array | None = None  # rotated basis
    # ([G, H, D] for the rows of a batched decode step, each row its own: turboquant/cache/rows.py)

    def arrays(self) -> dict[str, mx.array]:
        """The arrays a snapshot persists, by name."""
        return {k: v for k, v in (("scale", self.scale), ("rotated_scale", self.rotated_scale)) if v is not None}

    @classmethod
    def from_arrays(cls, arrays: dict[str, mx.array]) -> "KeyCalibration":
        """The calibration of persisted arrays: one object per set of array objects (`_FROM_ARRAYS`)."""
        unknown = set(arrays) - {"scale", "rotated_scale"}
        if unknown:
            raise ValueError(f"unknown calibration arrays: {sorted(unknown)}")
        names = sorted(arrays)
        sources = tuple(arrays[n] for n in names)
        return once(_FROM_ARRAYS, tuple(zip(names, map(id, sources))), sources, FROM_ARRAYS_KEPT, cls._float32, arrays)

    @classmethod
    def _float32(cls, arrays: dict[str, mx.array]) -> "KeyCalibration":
        return cls(**{k: v.astype(mx.float32) for k, v in arrays.items()})

    def keys_in(self, keys: mx.array) -> mx.array:
        """Original-basis transform of (centred) keys [B, H, T, D] before encoding."""
        return keys if self.scale is None else keys / self.scale[..., None, :]

    def keys_out(self, keys: mx.array) -> mx.array:
        """Inverse of `keys_in`."""
        return keys if self.scale is None else keys * self.scale[..., None, :]

    def codec_scale(self) -> mx.array | None:
        """Rotated-basis scale shaped to broadcast over [B, H, T, D], or None."""
        return None if self.rotated_scale is None else self.rotated_scale[..., None, :]

    def query_in(self, queries: mx.array) -> mx.array:
        """Original-basis query transform; queries grouped by KV head: [B, H, rows, D]."""
        return queries if self.scale is None else queries * self.scale[..., None, :]


def block_mean(keys: mx.array) -> mx.array:
    """Mean key of a block, pooled over batch and tokens: [B, H, T, D] -> [H, D] float32."""
    return mx.mean(keys.astype(mx.float32), axis=(0, 2))


def fit_key_calibration(
    keys: mx.array,
    rotation: Rotation | None,
    config: CalibrationConfig,
    query_power: mx.array | None = None,
) -> KeyCalibration | None:
    """Fit one layer's scales from its first prefill keys [B, H, T, D].

    `query_power` ([H, D], mean squared query per channel over the same tokens, pooled over
    the query heads of each KV head) makes the channel scales query-aware. Uses the first
    CALIBRATION_TOKENS tokens only, so the result depends on the first storage block alone.
    Returns None when there are fewer than MIN_ROWS rows or every part comes out flat.
    """
    return run(fitting(keys, rotation, config, query_power))


def fitting(keys: mx.array, rotation: Rotation | None, config: CalibrationConfig,
            query_power: mx.array | None = None) -> Stages[KeyCalibration | None]:
    """`fit_key_calibration` in stages (codec/stages.py), so that many layers fit with one
    evaluation per decision for all of them."""
    if not (config.channel_scale or config.rotated_scale):
        return None
    keys = keys[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    B, H, T, D = keys.shape
    if B * T < MIN_ROWS:
        return None
    rows = keys.transpose(1, 0, 2, 3).reshape(H, B * T, D)
    if config.center:
        rows = rows - mx.mean(rows, axis=1, keepdims=True)
    scale = None
    if config.channel_scale:
        power = mx.mean(rows * rows, axis=1)
        ratio = mx.sqrt(power) if query_power is None else mx.sqrt(power / mx.maximum(query_power, 1e-12))
        scale = mx.clip(mx.sqrt(_relative(ratio)), *SCALE_CLIP)
        scale = scale / mx.mean(scale, axis=-1, keepdims=True)
        if (yield from _flat(scale)):
            scale = None
        else:
            rows = rows / scale[:, None, :]
    rotated_scale = None
    if config.rotated_scale:
        if rotation is None:
            raise ValueError("rotated-basis calibration needs the key codec's rotation")
        norms = mx.sqrt(mx.sum(rows * rows, axis=-1, keepdims=True))
        sigma = mx.sqrt(mx.var(rotation.forward(rows / mx.maximum(norms, 1e-8)), axis=1))
        rotated_scale = mx.clip(_relative(sigma), *ROTATED_CLIP)
        if (yield from _flat(rotated_scale)):
            rotated_scale = None
    if scale is None and rotated_scale is None:
        return None
    result = KeyCalibration(scale=scale, rotated_scale=rotated_scale)
    yield list(result.arrays().values())
    return result


def noise_gain(keys: mx.array, calibration: "KeyCalibration | None", query_power: mx.array) -> mx.array:
    """How strongly key quantization noise reaches the scores of a layer, per KV head.

    For isotropic quantization noise of relative power D_mse in the calibrated domain,
    E[(q' . dk')^2] = D_mse * gain^2 with gain^2 = E|q'|^2 * E|k'|^2 / d, q' = q * s and
    k' = (k - mean) / s: the score error's std is gain * sqrt(D_mse) nats and the softmax KL
    about D_mse * gain^2 / 2. `query_power` is the mean squared (already scaled) query per
    channel, [H, D]; keys are the first block [B, H, T, D].
    """
    keys = keys[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    k = keys - mx.mean(keys, axis=(0, 2), keepdims=True)
    q_power = query_power
    if calibration is not None and calibration.scale is not None:
        k = k / calibration.scale[:, None, :]
        q_power = q_power * calibration.scale**2
    d = keys.shape[-1]
    key_power = mx.mean(mx.sum(k * k, axis=-1), axis=(0, 2))
    return mx.sqrt(mx.sum(q_power, axis=-1) * key_power / d)


def _relative(x: mx.array) -> mx.array:
    """x over its mean per head; a head whose x is all zero (all-zero keys) comes out flat (1)."""
    mean = mx.mean(x, axis=-1, keepdims=True)
    return mx.where(mean > 0, x / mx.where(mean > 0, mean, 1.0), 1.0)


def _flat(s: mx.array) -> Stages[bool]:
    deviation = mx.max(mx.abs(s - 1.0))
    yield [deviation]
    return bool(deviation.item() < FLAT_TOLERANCE)
