import math

import mlx.core as mx
import numpy as np
import pytest

from kv_data import kv_rows
from turboquant import parse_scheme
from turboquant.cache.compressed import CompressedKeys, TurboQuantKVCache
from turboquant.codec.plan import plan_layer
from turboquant.records import Layout

SCHEMES = ["turbo0v4", "turbo8v3", "turbo3", "affine8", "affine4", "turbo4v2"]
ULP = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}


def _cache(scheme, H, D, dtype, T0, seed=0, protected=False):
    plan = plan_layer(parse_scheme(scheme), H, D, D, dtype, protected=protected)
    if plan is None:
        return None
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(1, H, T0, D, seed=seed, dtype=dtype)
    cache.update_and_fetch(k, v)
    cache.compress()
    return cache


def _reference(q, k, v, scale, mask):
    """float64 attention over the dequantized cache."""
    q, k, v = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    B, Hq, L, D = q.shape
    H = k.shape[1]
    R = Hq // H
    k = np.repeat(k, R, axis=1)
    v = np.repeat(v, R, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("R", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("L", [1, 5])
def test_compressed_attention_equals_attention_over_dequantized_cache(D, R, dtype, L):
    H = 2
    scale = 1 / math.sqrt(D)
    layouts = set()
    for i, scheme in enumerate(SCHEMES):
        cache = _cache(scheme, H, D, dtype, T0=40, seed=i)
        if cache is None:
            assert D == 80 and scheme in ("turbo8v3", "affine8", "affine4")  # no affine group size
            continue
        k_new, v_new = kv_rows(1, H, L, D, seed=100 + i, dtype=dtype)
        keys, _ = cache.update_and_fetch(k_new, v_new)
        assert isinstance(keys, CompressedKeys) and keys.shape == (1, H, 40 + L, D)
        layouts.add(cache.layout)
        q = mx.random.normal((1, H * R, L, D), key=mx.random.key(i)).astype(dtype)
        mask = "causal" if L > 1 else None
        T = cache.offset
        np_mask = np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None] if L > 1 else None
        k_hat, v_hat = cache.dequantized()
        ref = _reference(q, k_hat, v_hat, scale, np_mask)
        out32 = np.array(cache.attention(q.astype(mx.float32), scale, mask)).astype(np.float64)
        assert np.abs(out32 - ref).max() <= 1e-4 * np.abs(ref).max(), scheme
        out = cache.attention(q, scale, mask)
        assert out.dtype == dtype
        # Within one ulp of the activation dtype (at each element's magnitude) after the cast.
        ulp = ULP[dtype] * 2.0 ** np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-14)))
        err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - ref)
        assert np.all(err <= ulp + 1e-4 * np.abs(ref).max()), scheme
    expected = {Layout.RAWK_TURBO, Layout.CALIBRATED, Layout.AFFINE, Layout.AFFINEK_TURBO}
    if D == 80:
        expected = {Layout.RAWK_TURBO, Layout.CALIBRATED}
    assert expected <= layouts


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per_head"])
def test_array_masks(mask_kind):
    H, R, D, L = 2, 3, 64, 4
    cache = _cache("turbo4", H, D, mx.float32, T0=30)
    k_new, v_new = kv_rows(1, H, L, D, seed=5)
    cache.update_and_fetch(k_new, v_new)
    T = cache.offset
    rng = np.random.default_rng(0)
    allowed = rng.random((L, T)) < 0.7
    allowed[:, 0] = True
    if mask_kind == "bool":
        mask = mx.array(allowed)
        np_mask = allowed
    elif mask_kind == "additive":
        mask = mx.array(np.where(allowed, 0.0, -1e9).astype(np.float32))
        np_mask = allowed
    else:
        per_head = rng.random((1, H * R, L, T)) < 0.7
        per_head[..., 0] = True
        mask = mx.array(per_head)
        np_mask = per_head
    q = mx.random.normal((1, H * R, L, D), key=mx.random.key(3))
    k_hat, v_hat = cache.dequantized()
    ref = _reference(q, k_hat, v_hat, 0.125, np_mask)
    out = np.array(cache.attention(q, 0.125, mask))
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


def test_bfloat16_key_of_70000_gives_no_inf_or_nan():
    for scheme in ["turbo0v4", "turbo8v3", "turbo4", "affine8"]:
        plan = plan_layer(parse_scheme(scheme), 2, 128, 128, mx.bfloat16)
        cache = TurboQuantKVCache(plan)
        k, v = kv_rows(1, 2, 64, 128, dtype=mx.bfloat16)
        k[:, :, 10, 7] = 70000.0
        cache.update_and_fetch(k, v)
        k1, v1 = kv_rows(1, 2, 1, 128, seed=1, dtype=mx.bfloat16)
        cache.update_and_fetch(k1, v1)
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(0)).astype(mx.bfloat16) * 30
        out = cache.attention(q, 1 / math.sqrt(128), None)
        assert out.dtype == mx.bfloat16
        assert mx.all(mx.isfinite(out)).item(), scheme


def test_raw_phase_returns_the_rows_themselves():
    plan = plan_layer(parse_scheme("turbo4"), 2, 64, 64, mx.float16)
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(1, 2, 10, 64, dtype=mx.float16)
    keys, values = cache.update_and_fetch(k, v)
    assert keys.dtype == mx.float16
    assert mx.array_equal(keys, k).item() and mx.array_equal(values, v).item()
    assert not cache.compressed and cache.layout is Layout.RAW


@pytest.mark.parametrize("numpy_stages", [True, False], ids=["cpu", "mlx-ops"])
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3", "turbo0v4", "affine8"])
def test_prefill_chunk_over_blocks_and_a_raw_tail(scheme, numpy_stages, monkeypatch):
    """A chunk that fills the open block and starts a raw tail (turboquant/attention/prefill.py): block
    means of calibrated keys, the tail's basis and the causal alignment all count, in the numpy
    decode of the CPU and in the MLX ops a GPU runs."""
    from turboquant.codec import numpy_stages as host

    monkeypatch.setattr(host, "on_host", lambda: numpy_stages)
    H, R, D, L = 2, 3, 64, 220
    cache = _cache(scheme, H, D, mx.float32, T0=300, seed=4)
    k_new, v_new = kv_rows(1, H, L, D, seed=9)
    cache.update_and_fetch(k_new[:, :, :-1], v_new[:, :, :-1])
    assert cache.stored == 300 and cache.offset == 519  # the chunk's rows wait raw in the tail
    cache.update_and_fetch(k_new[:, :, -1:], v_new[:, :, -1:])  # the next update encodes them
    assert cache.stored == 512 and cache.offset == 520
    q = mx.random.normal((1, H * R, L, D), key=mx.random.key(2))
    T = cache.offset
    k_hat, v_hat = cache.dequantized()
    ref = _reference(q, k_hat, v_hat, 0.125, np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None])
    out = np.array(cache.attention(q, 0.125, "causal"))
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("scheme", ["turbo8v3", "turbo4"])
def test_prefill_chunk_with_centred_keys_and_no_channel_scales(scheme):
    """Block means without channel scales: the means enter the scores' basis unscaled."""
    from turboquant.codec.calibration import CalibrationConfig

    H, R, D, L = 2, 2, 64, 8
    plan = plan_layer(parse_scheme(scheme), H, D, D, mx.float32,
                      calibration=CalibrationConfig(center=True, channel_scale=False))
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(1, H, 300, D, seed=6)
    cache.update_and_fetch(k, v)
    cache.compress()
    assert cache._shifts is not None and (cache.calibration is None or cache.calibration.scale is None)
    k_new, v_new = kv_rows(1, H, L, D, seed=7)
    cache.update_and_fetch(k_new, v_new)
    q = mx.random.normal((1, H * R, L, D), key=mx.random.key(4))
    T = cache.offset
    k_hat, v_hat = cache.dequantized()
    ref = _reference(q, k_hat, v_hat, 0.125, np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None])
    out = np.array(cache.attention(q, 0.125, "causal"))
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
