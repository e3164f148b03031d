"""Attention sinks (gpt-oss) over compressed storage in the plain-ops path: the sink logit joins
the softmax normaliser and mixes no value, exactly as mx.fast.scaled_dot_product_attention does
over the same (decoded) keys and values."""

import math

import mlx.core as mx
import pytest

from kernel_backend import force_backend
from kernel_support import emulate
from kv_data import kv_rows
from tiny_models import build_model, prompt_tokens
from turboquant import make_prompt_cache, parse_scheme, restore, snapshot
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.plan import plan_layer
from mlx_lm.models.cache import KVCache

# Both sides compute in float32 over the same decoded rows; they differ in summation order only.
# Outputs are convex mixes of values of magnitude O(1), so a few float32 ulps of the largest
# value, times the number of rows summed, bound the difference.
F32_EPS = 2.0**-23


@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3", "turbo0v4", "affine8"])
@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("tail", [0, 7])
def test_sinks_match_mlx_sdpa_over_decoded_rows(scheme, L, tail):
    H, R, D, T0 = 2, 3, 64, 300
    plan = plan_layer(parse_scheme(scheme), H, D, D, mx.float32)
    cache = TurboQuantKVCache(plan)
    cache.update_and_fetch(*kv_rows(1, H, T0, D, seed=1))
    cache.compress()
    if tail:  # rows past the last compressed block stay raw (the tail)
        cache.update_and_fetch(*kv_rows(1, H, tail, D, seed=2))
    new_k, new_v = kv_rows(1, H, L, D, seed=3)
    cache.update_and_fetch(new_k, new_v)
    keys, values = cache.dequantized()
    q = mx.random.normal((1, H * R, L, D), key=mx.random.key(4))
    sinks = mx.random.normal((H * R,), key=mx.random.key(5)) * 3
    scale = 1 / math.sqrt(D)
    mask = "causal" if L > 1 else None
    got = cache.attention(q, scale, mask, sinks)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
    without = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    T = keys.shape[2]
    bound = 8 * T * F32_EPS * float(mx.max(mx.abs(values)).item())
    assert float(mx.max(mx.abs(got - want)).item()) < bound
    assert float(mx.max(mx.abs(got - without)).item()) > 100 * bound  # the sinks did change the result


def _decoded_native(caches):
    """mlx-lm KVCaches holding what the compressed caches decode to (the reference's input)."""
    out = []
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            native = KVCache()
            keys, values = c.dequantized()
            native.update_and_fetch(keys.astype(mx.float32), values.astype(mx.float32))
            c = native
        out.append(c)
    return out


@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
def test_gpt_oss_decodes_over_compressed_storage_with_sinks(scheme):
    model = build_model("gpt_oss")
    for layer in model.model.layers:  # large sinks, so a dropped sink moves the logits
        layer.self_attn.sinks = 4 + 2 * mx.random.normal(layer.self_attn.sinks.shape, key=mx.random.key(7))
    caches = make_prompt_cache(model, scheme)
    assert sum(isinstance(c, TurboQuantKVCache) for c in caches) == 2  # the two full-attention layers
    model(prompt_tokens(40)[None], cache=caches)
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            c.compress()
    reference, sinkless = (_decoded_native(restore(snapshot(caches))) for _ in range(2))
    token = mx.array([[3]])
    got = model(token, cache=caches)
    want = model(token, cache=reference)
    for layer in model.model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    without = model(token, cache=sinkless)
    # The decoded token itself is quantized in `got` and raw in `want`: close, not equal; a
    # dropped sink would move the logits by far more.
    err, sink_effect = (float(mx.max(mx.abs(got - x)).item()) for x in (want, without))
    assert err < sink_effect / 10



def _fused_against_plain(monkeypatch, scheme: str) -> None:
    """gpt_oss's decode step reaches fused_decode with its sinks in both full-attention layers,
    the kernels answer, and the logits are the plain path's."""
    from turboquant.attention import compressed as attention
    from turboquant.attention import kernels

    model = build_model("gpt_oss")
    for layer in model.model.layers:
        layer.self_attn.sinks = 4 + 2 * mx.random.normal(layer.self_attn.sinks.shape, key=mx.random.key(7))
    caches = make_prompt_cache(model, scheme)
    model(prompt_tokens(300)[None], cache=caches)
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            c.compress()
    snap = snapshot(caches)
    answered = []
    original = attention.fused_decode

    def counting(*args, **kwargs):  # `memo` (the replayed step) comes as a keyword
        out = original(*args, **kwargs)
        answered.append(out is not None and args[-1] is not None)
        return out

    monkeypatch.setattr(attention, "fused_decode", counting)
    token = mx.array([[3]])
    fused = model(token, cache=restore(snap))
    mx.eval(fused)
    assert answered == [True, True]
    monkeypatch.setattr(kernels, "select_backend", lambda: None)
    plain = model(token, cache=restore(snap))
    err = float(mx.max(mx.abs(fused - plain)).item())
    assert err < 1e-3 * float(mx.max(mx.abs(plain)).item()), err


@pytest.mark.slow  # 20-45 s: the emulator compiles and runs the kernels on the CPU
@pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
def test_gpt_oss_sinks_reach_the_emulated_kernels(scheme, monkeypatch):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    _fused_against_plain(monkeypatch, scheme)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
def test_gpt_oss_sinks_through_the_gpu_kernels(scheme, monkeypatch):
    """On the device machine: `python3 -m pytest -m gpu tests/test_sinks.py`."""
    monkeypatch.setenv("TQSTORE_MIRROR_TOKENS", "0")  # the kernels, not a decoded mirror, at this length
    before = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        _fused_against_plain(monkeypatch, scheme)
    finally:
        mx.set_default_device(before)
