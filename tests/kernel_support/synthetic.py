"""Benchmark and test support: synthetic compressed caches and the float64 attention they must match.

In the package because `bench/decode.py` builds its caches and checks its outputs with it; the
tests' shorthand over it (`reference`) and the CPU emulator of the kernels live in
tests/kernel_support. The reference dequantizes the stored rows exactly (affine scale * code +
bias in float32, no rounding to the scale dtype; TurboQuant rows through the codec on the CPU)
and runs attention in float64 with numpy.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.calibration import CalibrationConfig
from turboquant.codec.plan import BASE_KEYS, plan_layer
from turboquant.codec.schemes import parse_scheme
from turboquant.attention.kernels.host import exact_arrays

UNCALIBRATED = CalibrationConfig(center=False, channel_scale=False, rotated_scale=False)
PROTECTED = "protected"


def kv_rows(B: int, H: int, T: int, D: int, seed: int = 0, dtype=mx.float32, outlier: float = 40.0):
    """K [B, H, T, D] with three outlier channels (a constant bias plus spread), V [B, H, T, D]."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D), dtype=np.float32)
    channels = rng.choice(D, 3, replace=False)
    k[..., channels] = k[..., channels] * 4 + outlier * np.array([1.0, -0.6, 0.4], dtype=np.float32)
    v = rng.standard_normal((B, H, T, D), dtype=np.float32) * 0.5
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def build_cache(scheme: str, H: int, D: int, dtype, T: int, *, seed: int = 0, tail: int = 0,
                calibrated: bool = True, B: int = 1, keys: str = BASE_KEYS) -> TurboQuantKVCache | None:
    """A compressed cache of T stored rows (plus `tail` raw rows), or None when the scheme keeps
    this head dim native. `calibrated=False` gives the plain turbo layout (no key means).
    `keys`: the layer's key layout as an auto scheme's allocation leaves it (one of the plan's
    `key_options`), or "protected" (the guard's layout: affine8 keys, values as the scheme says)."""
    kw = {} if calibrated else {"calibration": UNCALIBRATED}
    plan = plan_layer(parse_scheme(scheme), H, D, D, dtype, **kw)
    if plan is None:
        return None
    plan = plan.protected_plan() if keys == PROTECTED else plan.with_keys(keys)
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(B, H, T, D, seed=seed, dtype=dtype)
    cache.update_and_fetch(k, v)
    cache.compress()
    if tail:
        # Rows after a compressed block boundary go to the raw tail; otherwise they fill the
        # open block first (then only the remainder is raw).
        kt, vt = kv_rows(B, H, tail, D, seed=seed + 1000, dtype=dtype)
        for i in range(tail):
            cache.update_and_fetch(kt[:, :, i:i + 1], vt[:, :, i:i + 1])
    mx.eval(*cache.state)
    return cache


def stored(cache: TurboQuantKVCache) -> dict[str, mx.array]:
    return cache._store.view(cache.stored) if cache.stored else {}


def tail(cache: TurboQuantKVCache):
    if cache.offset <= cache.stored:
        return None
    view = cache._tail.view(cache.offset - cache.stored)
    return view["keys"], view["values"]


def dequantized(cache: TurboQuantKVCache) -> tuple[np.ndarray, np.ndarray]:
    """Stored rows and tail, exactly dequantized, float64 [B, H, T, D] (on the CPU)."""
    with mx.stream(mx.cpu):
        arrays = exact_arrays(stored(cache))
        parts_k, parts_v = [], []
        if arrays:
            parts_k.append(cache._key_side.decode(arrays, cache._shifts).astype(mx.float32))
            parts_v.append(cache._value_side.decode(arrays).astype(mx.float32))
        t = tail(cache)
        if t is not None:
            parts_k.append(t[0].astype(mx.float32))
            parts_v.append(t[1].astype(mx.float32))
        k = mx.concatenate(parts_k, axis=2)
        v = mx.concatenate(parts_v, axis=2)
        mx.eval(k, v)
    return np.array(k).astype(np.float64), np.array(v).astype(np.float64)


def attention64(q: mx.array, k: np.ndarray, v: np.ndarray, scale: float,
                sinks: mx.array | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out [B, Hq, L, D], lse [B, Hq, L]) in float64; query head h reads KV head h // R.
    `sinks` [Hq]: one more logit per query head in the normaliser (and the lse), no value."""
    with mx.stream(mx.cpu):
        qn = np.array(q.astype(mx.float32)).astype(np.float64)
        sk = None if sinks is None else np.array(sinks.astype(mx.float32)).astype(np.float64)
    R = qn.shape[1] // k.shape[1]
    k = np.repeat(k, R, axis=1)
    v = np.repeat(v, R, axis=1)
    s = qn @ k.swapaxes(-1, -2) * scale
    m = s.max(-1, keepdims=True)
    if sk is not None:
        sk = np.broadcast_to(sk[None, :, None, None], m.shape)
        m = np.maximum(m, sk)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True) + (0.0 if sk is None else np.exp(sk - m))
    return (p / den) @ v, (m + np.log(den))[..., 0]
