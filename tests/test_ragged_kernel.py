"""The one-token attention over rows of their own lengths (turboquant/attention/kernels/ragged.py),
run on the CPU through the emulator: each row's output is its own attention over its first
lengths[b] keys, as alone, within the float32 sums' rounding (and the output dtype's)."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention.kernels import ragged_decode
from turboquant.attention.kernels.ragged import variant

from kernel_backend import force_backend
from kernel_support import emulate

pytestmark = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


def _rows(B, H, R, D, T, dtype, seed):
    """Queries [B, H * R, 1, D], keys and values [B, H, T, D]."""
    return [mx.random.normal(s, key=mx.random.key(seed + i)).astype(dtype)
            for i, s in enumerate(((B, H * R, 1, D), (B, H, T, D), (B, H, T, D)))]


@pytest.mark.parametrize("dtype, D, R", [(mx.float32, 64, 4), (mx.bfloat16, 80, 2), (mx.float16, 128, 1)], ids=str)
def test_each_row_attends_over_its_own_first_keys(monkeypatch, dtype, D, R):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    B, H, T = 3, 2, 48
    q, k, v = _rows(B, H, R, D, T, dtype, seed=7)
    lengths = [1, 19, 45]
    # the group's buffers are token slices of larger ones: read in place through their strides
    out = ragged_decode(q, k[:, :, :45], v[:, :, :45], mx.array(lengths), scale=D ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(lengths):
        alone = mx.fast.scaled_dot_product_attention(
            q[b:b + 1].astype(mx.float32), k[b:b + 1, :, :n].astype(mx.float32),
            v[b:b + 1, :, :n].astype(mx.float32), scale=D ** -0.5)
        got, want = np.array(out[b:b + 1].astype(mx.float32)), np.array(alone)
        # float32 sums in another order; then one rounding into the output dtype
        tol = 2e-6 if dtype == mx.float32 else float(np.finfo(np.float16).eps if dtype == mx.float16 else 2 ** -7)
        assert np.max(np.abs(got - want)) <= tol * max(1.0, float(np.max(np.abs(want)))), (b, n)
    # the first row sees one key: its output is that key's value, exactly
    assert np.array_equal(np.array(out[0, :, 0].astype(mx.float32)),
                          np.array(mx.repeat(v[0, :, 0], R, axis=0).astype(mx.float32)))


def test_the_masked_sdpa_it_replaces_gives_the_same_answers(monkeypatch):
    """What the decode batch ran before: one masked SDPA over the group's padded buffers."""
    force_backend(monkeypatch, "cuda", emulate.kernel)
    B, H, R, D, T = 4, 2, 4, 64, 33
    q, k, v = _rows(B, H, R, D, T, mx.float32, seed=11)
    positions = mx.array([32, 5, 20, 0])
    mask = (mx.arange(T)[None, :] <= positions[:, None])[:, None, None, :]
    masked = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    out = ragged_decode(q, k, v, positions + 1, scale=0.125)
    assert np.allclose(np.array(out), np.array(masked), rtol=1e-5, atol=1e-6)


def test_it_declines_where_no_kernel_applies(monkeypatch):
    q, k, v = _rows(2, 2, 4, 64, 8, mx.float32, seed=1)
    lengths = mx.array([3, 8])
    monkeypatch.setattr("turboquant.attention.kernels.select_backend", lambda: None)
    assert ragged_decode(q, k, v, lengths, 0.125) is None  # the CPU: the masked SDPA stays
    assert variant(mx.concatenate([q, q], axis=2), k, v, 0.125) is None  # two query tokens
    assert variant(q, k.astype(mx.float16), v, 0.125) is None  # mixed dtypes
    assert variant(q[:, :3], k, v, 0.125) is None  # 3 query heads over 2 KV heads
    wide = mx.zeros((1, 2, 1, 512))
    assert variant(wide, mx.zeros((1, 2, 4, 512)), mx.zeros((1, 2, 4, 512)), 0.1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=str)
def test_on_the_gpu_each_row_matches_its_own_attention(dtype):
    """The kernel on CUDA, at the 8B model's shapes (32 query / 8 KV heads, d=128), rows of 1 to
    1,000 keys in a 1,024-token buffer: every row against its own SDPA in float32."""
    from turboquant.attention.kernels import select_backend

    before = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        if select_backend() != "cuda":
            pytest.skip("needs MLX's CUDA backend")
        _rows_against_sdpa(dtype)
    finally:
        mx.set_default_device(before)


def _rows_against_sdpa(dtype):
    B, H, R, D, T = 8, 8, 4, 128, 1024
    q, k, v = _rows(B, H, R, D, T, dtype, seed=5)
    lengths = [1, 2, 31, 32, 33, 257, 700, 1000]
    out = ragged_decode(q, k, v, mx.array(lengths), scale=D ** -0.5)
    for b, n in enumerate(lengths):
        alone = mx.fast.scaled_dot_product_attention(
            q[b:b + 1].astype(mx.float32), k[b:b + 1, :, :n].astype(mx.float32),
            v[b:b + 1, :, :n].astype(mx.float32), scale=D ** -0.5, stream=mx.cpu)
        got, want = np.array(out[b:b + 1].astype(mx.float32)), np.array(alone)
        tol = 1e-5 if dtype == mx.float32 else 2 ** -7
        assert np.max(np.abs(got - want)) <= tol * max(1.0, float(np.max(np.abs(want)))), (b, n)
