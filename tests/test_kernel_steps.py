"""A layer's decode step prepared once and replayed (`turboquant/attention/kernels/steps.py`), run on the
CPU through the emulator: each replayed step equals the step built from scratch, bit for bit,
across new tail rows, a block that fills (new stored rows, key means and buffers) and a trim, and
the step is rebuilt only when something it holds changes."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels import host
from kernel_support.synthetic import build_cache

from kernel_backend import force_backend
from kernel_support import emulate

pytestmark = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


# turbo4 (the default scheme) by default; turbo8v3 at bfloat16 with -m slow (the replay is the same code).
@pytest.mark.parametrize("scheme, dtype", [("turbo4", mx.float16),
                                           pytest.param("turbo8v3", mx.bfloat16, marks=pytest.mark.slow)], ids=str)
def test_replayed_steps_equal_steps_built_from_scratch(monkeypatch, scheme, dtype):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    described = []
    describe = host.describe
    monkeypatch.setattr(host, "describe", lambda *a, **k: described.append(1) or describe(*a, **k))
    H, D = 2, 64
    cache = build_cache(scheme, H, D, dtype, 256, seed=3, tail=250)
    k, v = (mx.random.normal((1, H, 12, D), key=mx.random.key(s)).astype(dtype) for s in (1, 2))
    for t in range(12):  # 256 + 250 rows, then across the block boundary at 512
        q = mx.random.normal((1, 4 * H, 1, D), key=mx.random.key(10 + t)).astype(dtype)
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t == 9:
            cache.trim(2)
        tail = (cache._tail.arrays["keys"], cache._tail.arrays["values"])
        args = (q, cache._key_side, cache._value_side, cache._store.arrays, 0.125, cache._shifts, tail, cache.stored,
                cache.offset - cache.stored)
        fresh = kernels.fused_decode(*args)
        before = len(described)
        replayed = cache.attention(q, 0.125)
        assert np.array_equal(np.array(replayed.astype(mx.float32)), np.array(fresh[0].astype(mx.float32))), t
        rebuilt = len(described) > before
        # built at the first step and once the rows up to 512 were encoded (t = 6: new rows, means,
        # buffers); replayed otherwise, the trim included
        assert rebuilt == (t in (0, 6)), t
    assert cache.stored == 512
