"""Synthetic K/V rows shaped like real ones: Gaussian with a few large outlier key channels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def kv_rows(B: int, H: int, T: int, D: int, seed: int = 0, dtype=mx.float32, outlier: float = 40.0):
    """K [B, H, T, D] with three outlier channels (a constant bias plus spread), V [B, H, T, D]."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D))
    channels = rng.choice(D, 3, replace=False)
    k[..., channels] = k[..., channels] * 4 + outlier * np.array([1.0, -0.6, 0.4])
    v = rng.standard_normal((B, H, T, D)) * 0.5
    return mx.array(k.astype(np.float32)).astype(dtype), mx.array(v.astype(np.float32)).astype(dtype)
