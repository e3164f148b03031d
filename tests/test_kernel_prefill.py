"""A question's prefill over compressed storage through the decode kernels (`fused_prefill`),
run on the CPU through the emulator against a float64 causal attention.

The L tokens of each query head become L more query rows of its KV head; the stored rows precede
every query, and the raw tail (whose last L rows are the question) joins under the causal mask.
Tolerances: the CUDA-core kernel (float32 activations) at 1e-4 of the largest output, the
tensor-core one (fp16 products) and fp16/bf16 outputs at 2 ulp + 2e-3 of it, as for a decode step."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention.kernels import KernelTuning
from turboquant.attention.kernels.mma import MmaPass1
from kernel_support.synthetic import build_cache, dequantized

from kernel_backend import force_backend
from kernel_support import emulate, on_demand
from kernel_support.reference import causal64

pytestmark = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")

H, R, D = 2, 4, 64
ULP = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 0.0}


CASES = [("turbo4", mx.float16, MmaPass1), ("turbo8v3", mx.bfloat16, MmaPass1),
         ("turbo4", mx.float32, None), ("affine8", mx.float16, None), ("turbo0v4", mx.bfloat16, None),
         ("turbo5v4", mx.float16, MmaPass1), ("auto3.5", mx.float32, None)]


# One tensor-core and one CUDA-core case by default; the other layouts with -m slow.
@pytest.mark.parametrize("case", on_demand(CASES, keep={0, 2}), ids=lambda c: f"{c[0]}-{str(c[1]).split('.')[-1]}")
def test_question_through_the_kernels_matches_f64(monkeypatch, case):
    scheme, dtype, pass1 = case
    calls = []

    def factory(v):
        calls.append(v)
        return emulate.kernel(v)

    force_backend(monkeypatch, "cuda", factory)
    cache = build_cache(scheme, H, D, dtype, 256, seed=5, tail=37)
    assert (cache.stored, cache.offset) == (256, 293)
    k64, v64 = dequantized(cache)
    q = mx.random.normal((1, H * R, 5, D), key=mx.random.key(3)).astype(dtype)
    for mask in ("causal", None):
        calls.clear()
        out = cache.attention(q, 0.125, mask)
        assert out.dtype == dtype and out.shape == q.shape
        assert len(calls) == 2  # pass 1 over the stored rows, pass 2 with the tail (causal per row)
        assert calls[1].tail_dtype
        if pass1 is not None:
            assert isinstance(calls[0], pass1)
        if pass1 is MmaPass1:  # R * L = 20 rows: two row tiles per threadgroup, K/V read twice (not 3 times)
            assert calls[0].rmax == 16
        ref = causal64(q, k64, v64, 0.125, mask == "causal")
        rtol = 1e-4 if dtype == mx.float32 else 2e-3
        err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - ref)
        assert np.all(err <= 2 * ULP[dtype] * np.abs(ref) + rtol * np.abs(ref).max()), (mask, err.max())


@pytest.mark.parametrize("T, tail", [(300, 9), (256, 300)], ids=["open-block", "tail-past-pass-2"])
def test_question_after_a_restore_in_an_open_block(monkeypatch, T, tail):
    """Issue 28/30: a question after a restore whose last block is open (300 rows) kept its rows
    encoded at once, so fewer than L stayed in the tail and it decoded every stored row
    (turboquant/attention/prefill.py). They now wait in the tail and the kernels take it; a tail longer
    than pass 2 takes (256 rows) joins with plain ops, still causal per row."""
    calls = []
    force_backend(monkeypatch, "cuda", lambda v: calls.append(v) or emulate.kernel(v))
    cache = build_cache("turbo4", H, D, mx.float16, T, seed=8)
    k, v = (mx.random.normal((1, H, tail, D), key=mx.random.key(s)).astype(mx.float16) for s in (1, 2))
    cache.update_and_fetch(k, v)
    assert cache.offset - cache.stored == tail and cache.stored == T
    k64, v64 = dequantized(cache)
    q = mx.random.normal((1, H * R, 5, D), key=mx.random.key(6)).astype(mx.float16)
    out = cache.attention(q, 0.125, "causal")
    assert len(calls) == 2 and bool(calls[1].tail_dtype) == (tail <= 256)
    ref = causal64(q, k64, v64, 0.125, True)
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - ref)
    assert np.all(err <= 2 * ULP[mx.float16] * np.abs(ref) + 2e-3 * np.abs(ref).max()), err.max()


def test_queries_reaching_into_the_stored_rows_take_the_plain_path(monkeypatch):
    """More queries than tail rows (some of their keys are stored: the mask would reach into the
    stored rows), an array mask or attention sinks: no kernel runs, and the result still matches."""
    calls = []

    def factory(v):
        calls.append(v)
        return emulate.kernel(v)

    force_backend(monkeypatch, "cuda", factory, tuning=KernelTuning())
    cache = build_cache("turbo4", H, D, mx.float16, 256, seed=6, tail=3)
    k64, v64 = dequantized(cache)
    q = mx.random.normal((1, H * R, 5, D), key=mx.random.key(4)).astype(mx.float16)
    out = cache.attention(q, 0.125, "causal")
    ref = causal64(q, k64, v64, 0.125, True)
    assert np.abs(np.array(out.astype(mx.float32)) - ref).max() <= 4e-3 * np.abs(ref).max()
    cache.attention(q, 0.125, mx.ones((5, cache.offset), dtype=mx.bool_))
    cache.attention(q[:, :, :3], 0.125, "causal", sinks=mx.zeros((H * R,)))
    assert calls == []


def test_long_chunks_decode_the_rows(monkeypatch):
    """Past MAX_PREFILL_ROWS query rows per KV head (the kernels would read the stored rows once
    per 8 of them) a chunk takes the decoded rows, even with every query in the tail."""
    from turboquant.attention import kernels

    class Picked(Exception):
        """The kernels were chosen; what they compute is the f64 tests' job (emulating these
        rows costs half a minute)."""

    calls = []

    def pick(variant):
        calls.append(variant)
        raise Picked

    force_backend(monkeypatch, "cuda", pick)
    L = kernels.MAX_PREFILL_ROWS // R + 1
    cache = build_cache("turbo4", H, D, mx.float16, 256, seed=7, tail=L)
    assert cache.offset - cache.stored == L
    q = mx.random.normal((1, H * R, L, D), key=mx.random.key(5)).astype(mx.float16)
    out = cache.attention(q, 0.125, "causal")
    assert calls == [] and out.shape == q.shape
    with pytest.raises(Picked):
        cache.attention(q[:, :, -(L - 1):], 0.125, "causal")
    assert calls


@pytest.mark.parametrize("D, B", [(64, 1), (256, 2)], ids=["d64", "d256-batch2"])
def test_question_rows_that_see_part_of_the_tail(monkeypatch, D, B):
    """16 queries over a 40-row tail: query l sees the tail's first 25 + l rows (causal), every
    batch row its own tail; at D = 256 pass 2 loads each key row as 32 words of 16 bytes."""
    calls = []
    force_backend(monkeypatch, "cuda", lambda v: calls.append(v) or emulate.kernel(v))
    cache = build_cache("turbo4", 2, D, mx.float16, 256, seed=4, tail=40, B=B)
    assert cache.offset - cache.stored == 40
    k64, v64 = dequantized(cache)
    q = mx.random.normal((B, 4, 16, D), key=mx.random.key(7)).astype(mx.float16)
    out = cache.attention(q, D ** -0.5, "causal")
    assert len(calls) == 2 and calls[1].tail_dtype == "float16"
    ref = causal64(q, k64, v64, D ** -0.5, True)
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - ref)
    assert np.all(err <= 2 * ULP[mx.float16] * np.abs(ref) + 2e-3 * np.abs(ref).max()), err.max()
