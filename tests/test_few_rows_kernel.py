"""x W^T for a decode batch's few rows (turboquant/attention/kernels/few_rows.py), run on the CPU
through the emulator: within the float32 sums' rounding and one rounding into the output dtype
of the product in float64, each row's result independent of the rows beside it, and the layer
adapter (turboquant/adapter/few_rows.py) routing only 2-8 rows to it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from turboquant.attention.kernels import rows_matmul
from turboquant.attention.kernels.few_rows import MMAX, variant

from kernel_backend import force_backend
from kernel_support import emulate

pytestmark = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")

EPS = {mx.bfloat16: 2.0 ** -8, mx.float16: 2.0 ** -11}


def _operands(M, N, K, dtype, seed):
    x = mx.random.normal((M, K), key=mx.random.key(seed)).astype(dtype)
    w = (0.1 * mx.random.normal((N, K), key=mx.random.key(seed + 1))).astype(dtype)
    return x, w


def _check(y, x, w, dtype):
    x64, w64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (x, w))
    want = x64 @ w64.T
    bound = np.abs(x64) @ np.abs(w64).T  # float32 sums of K products: within K * 2^-24 of it
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= EPS[dtype] * np.abs(want) + x.shape[-1] * 2.0 ** -24 * bound)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_rows_times_weights_and_each_row_on_its_own(monkeypatch, dtype):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    N, K = 37, 264  # output rows not a multiple of a threadgroup's 8; K past one 256-wide step
    x, w = _operands(MMAX, N, K, dtype, seed=3)
    y = rows_matmul(x, w)
    assert y.shape == (MMAX, N) and y.dtype == dtype
    _check(y, x, w, dtype)
    for m in (1, 3):  # the same order of sums for a row whatever rows come with it: bit for bit
        alone = rows_matmul(x[:m], w)
        assert np.array_equal(np.array(alone.astype(mx.float32)), np.array(y[:m].astype(mx.float32)))


def test_leading_axes_and_refusals(monkeypatch):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    x, w = _operands(4, 16, 64, mx.bfloat16, seed=5)
    y = rows_matmul(x.reshape(4, 1, 64), w)  # a decode step's [rows, 1, hidden]
    assert y.shape == (4, 1, 16)
    _check(y.reshape(4, 16), x, w, mx.bfloat16)
    assert variant(mx.zeros((MMAX + 1, 64), mx.bfloat16), w) is None  # more rows: MLX's matmul
    assert variant(x.astype(mx.float32), w.astype(mx.float32)) is None
    assert variant(mx.zeros((2, 60), mx.bfloat16), mx.zeros((16, 60), mx.bfloat16)) is None  # K % 8
    assert variant(x, w.astype(mx.float16)) is None
    monkeypatch.setattr("turboquant.attention.kernels.select_backend", lambda: "cpu")
    assert rows_matmul(x, w) is None


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 24, bias=True)
        self.second = nn.Linear(24, 16, bias=False)


def test_the_adapter_routes_two_to_eight_rows(monkeypatch):
    from turboquant import use_few_rows_matmul

    force_backend(monkeypatch, "cuda", emulate.kernel)
    launched = []
    real = emulate.kernel
    monkeypatch.setattr("turboquant.attention.kernels.cuda.kernel", lambda v: launched.append(v) or real(v))
    model = Two()
    model.set_dtype(mx.bfloat16)
    assert use_few_rows_matmul(model) == 2
    assert use_few_rows_matmul(model) == 0  # idempotent
    x = mx.random.normal((3, 1, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    first = model.first
    y = first(x)
    assert len(launched) == 1
    want = mx.addmm(first.bias, x, first.weight.T)
    assert np.max(np.abs(np.array((y - want).astype(mx.float32)))) <= 2 ** -6 * float(mx.abs(want).max())
    launched.clear()
    for rows in (1, MMAX + 1):  # one row: MLX's own matrix-vector kernel; more than MMAX: its matmul
        z = mx.random.normal((rows, 64), key=mx.random.key(2)).astype(mx.bfloat16)
        assert mx.array_equal(first(z), mx.addmm(first.bias, z, first.weight.T))
    assert not launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_on_the_gpu_the_kernel_matches_the_product(dtype):
    """On CUDA (the H200): the 8B model's projection shapes, 2-8 rows, against float64."""
    if not (mx.cuda.is_available() if hasattr(mx, "cuda") else False):
        pytest.skip("needs MLX's CUDA backend")
    mx.set_default_device(mx.gpu)
    try:
        for (N, K), M in [((4096, 4096), 2), ((1024, 4096), 8), ((14336, 4096), 5), ((4096, 14336), 8),
                          ((32000, 4096), 3)]:
            x, w = _operands(M, N, K, dtype, seed=M)
            y = rows_matmul(x, w)
            assert y is not None and y.shape == (M, N)
            _check(y, x, w, dtype)
            assert np.array_equal(np.array(rows_matmul(x[:1], w).astype(mx.float32)), np.array(y[:1].astype(mx.float32)))
    finally:
        mx.set_default_device(mx.cpu)
