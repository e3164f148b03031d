"""A compressed layer's decoded mirror (turboquant/cache/mirror.py): while the context is short,
attention on CUDA is MLX's SDPA over the rows decoded. Run here by routing the backend choice
to "cuda" (the mirror path itself is plain MLX): at every step its rows are exactly the
storage's decoded rows and the raw tail, across appended tokens, a block encoded, a trim, a
restore and the length where the fused kernels take over."""

import re

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import kernels
from turboquant.attention.compressed import compressed_attention
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.adapter.making import compress_caches
from turboquant.cache.mirror import MIRROR_ENV, DecodedStack, mirror_tokens
from turboquant import make_prompt_cache
from kernel_support.synthetic import build_cache, kv_rows

from kernel_backend import force_backend
from tiny_models import build_model
from kernel_support import emulate


def _decoded_sdpa(cache, q, scale):
    """SDPA over the storage decoded now, from scratch."""
    k, v = cache.dequantized()
    return mx.fast.scaled_dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale)


def _plain(monkeypatch, cache, q, scale):
    """The plain-ops path over the compressed storage (the CPU's)."""
    tail = (cache._tail.arrays["keys"], cache._tail.arrays["values"]) if cache.offset > cache.stored else None
    with monkeypatch.context() as m:
        m.setattr(kernels, "select_backend", lambda: None)
        return compressed_attention(q, cache._key_side, cache._value_side, cache._store.view(cache.stored), scale,
                                    None, cache._shifts, tail, None, cache.offset - cache.stored)


@pytest.mark.parametrize("scheme", ["turbo5v4", "turbo4"])
def test_the_mirror_follows_the_storage_step_by_step(monkeypatch, scheme):
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    H, D = 2, 64
    cache = build_cache(scheme, H, D, mx.float32, 300, seed=3)
    k, v = kv_rows(1, H, 230, D, seed=9, dtype=mx.float32)
    for t in range(230):  # 300 stored rows, then across the block boundary at 512, with trims
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t in (40, 215):
            cache.trim(3)
        q = mx.random.normal((1, 4 * H, 1, D), key=mx.random.key(t))
        out = cache.attention(q, 0.125)
        assert cache._mirror is not None
        assert np.array_equal(np.array(out), np.array(_decoded_sdpa(cache, q, 0.125))), t
        # the same attention as over the compressed storage, up to float32 sums in another order
        assert np.allclose(np.array(out), np.array(_plain(monkeypatch, cache, q, 0.125)), rtol=1e-4, atol=1e-5), t
    assert cache.stored == 512 and cache.offset == 524


def test_a_restored_layer_and_a_question_read_the_mirror(monkeypatch):
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    H, D = 2, 64
    cache = build_cache("turbo5v4", H, D, mx.float32, 200, seed=4, tail=70)
    cache.attention(mx.zeros((1, 4 * H, 1, D)), 0.125)
    restored = TurboQuantKVCache.from_record(cache.to_record(), cache.plan.codecs())
    k, v = kv_rows(1, H, 5, D, seed=5, dtype=mx.float32)
    restored.update_and_fetch(k, v)  # a 5-token question: its rows are the tail's last
    q = mx.random.normal((1, 4 * H, 5, D), key=mx.random.key(1))
    out = restored.attention(q, 0.125, mask="causal")
    dk, dv = restored.dequantized()
    want = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=0.125, mask="causal")
    assert np.array_equal(np.array(out), np.array(want))


@pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")
def test_past_the_threshold_the_kernels_read_the_storage(monkeypatch):
    assert mirror_tokens() == 0  # the CPU: no mirror
    force_backend(monkeypatch, "cuda", emulate.kernel)
    monkeypatch.setenv(MIRROR_ENV, "256")
    H, D = 2, 64
    cache = build_cache("turbo5v4", H, D, mx.float32, 250, seed=6)
    q = mx.random.normal((1, 4 * H, 1, D), key=mx.random.key(2))
    cache.attention(q, 0.125)
    assert cache._mirror is not None
    k, v = kv_rows(1, H, 10, D, seed=7, dtype=mx.float32)
    for t in range(10):
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    got = cache.attention(q, 0.125)  # 260 tokens: the fused kernels (emulated) over the storage
    assert cache._mirror is None
    assert np.allclose(np.array(got), np.array(_plain(monkeypatch, cache, q, 0.125)), rtol=1e-4, atol=1e-5)
    monkeypatch.setenv(MIRROR_ENV, "0")
    assert mirror_tokens() == 0


@pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")
def test_stacked_mirrors_attend_as_each_row_alone(monkeypatch):
    """Three rows of other lengths, stacked (the decode batch's form on CUDA, its kernel run by
    the emulator here): per step the stack adds each row's new row (held by the stack alone
    while the rows only step, the caches counting it) and each row's output is what its twin
    cache, stepped on its own, attends to: across steps that only append, a block encoded in
    one row (stored rows change), a trim and a row leaving. The caches end holding their
    twins' records bit for bit."""
    force_backend(monkeypatch, "cuda", emulate.kernel)
    monkeypatch.setenv(MIRROR_ENV, "1024")
    H, D = 2, 64
    shapes = ((20, 1), (100, 2), (253, 3))
    caches, twins = ([build_cache("turbo5v4", H, D, mx.float32, n, seed=s) for n, s in shapes] for _ in range(2))
    stack = DecodedStack()
    k, v = kv_rows(3, H, 6, D, seed=4, dtype=mx.float32)
    lent = []
    for t in range(6):  # row 3 fills its open block at t = 2 (encoded at the next update)
        live = slice(0, 3 if t < 5 else 2)
        if t == 3:
            for c in (caches[0], twins[0]):
                c.trim(1)
        q = mx.random.normal((len(caches[live]), 4 * H, 1, D), key=mx.random.key(t))
        out = stack.attend(caches[live], k[live, :, t:t + 1], v[live, :, t:t + 1], q, 0.125)
        lent.append([c._lent for c in caches])
        for i, c in enumerate(twins[live]):
            c.update_and_fetch(k[i:i + 1, :, t:t + 1], v[i:i + 1, :, t:t + 1])
            alone = c.attention(q[i:i + 1], 0.125)
            # float32 sums of up to 256 rows in another order: within n * eps * max|v| (about 1e-4)
            assert np.abs(np.array(out[i:i + 1]) - np.array(alone)).max() <= 256 * 2 ** -23 * 4, (t, i)
    assert caches[2].stored == 256
    assert lent[1] == [1, 1, 1] and lent[2] == [2, 2, 2]  # held by the stack alone between rebuilds
    for a, b in zip(caches, twins):
        ra, rb = a.to_record(), b.to_record()
        assert ra.offset == rb.offset and all(mx.array_equal(ra.arrays[n], rb.arrays[n]).item() for n in ra.arrays)


@pytest.mark.parametrize("scheme", ["turbo5v4", "turbo4"])
def test_rows_the_mirror_alone_takes_reach_the_record_bit_exactly(monkeypatch, scheme):
    """While the mirror is current a decode step writes its row there alone (one write, as a raw
    cache's); a snapshot, a trim, a block encoded and the mirror's drop past the threshold each
    settle those rows into the tail: the records equal those of a cache that never mirrored."""
    H, D = 2, 64
    mirrored = build_cache(scheme, H, D, mx.float32, 300, seed=11)
    plain = build_cache(scheme, H, D, mx.float32, 300, seed=11)
    k, v = kv_rows(1, H, 230, D, seed=12, dtype=mx.float32)
    monkeypatch.setenv(MIRROR_ENV, "520")
    for t in range(230):  # across the block boundary at 512 and the threshold at 520
        for cache, backend in ((mirrored, "cuda"), (plain, None)):
            monkeypatch.setattr(kernels, "select_backend", lambda b=backend: b)
            cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
            if t in (40, 150):
                cache.trim(3)
            if backend == "cuda":
                # (past the threshold the plain path stands in for the fused kernels: both drop the mirror)
                monkeypatch.setattr(kernels, "select_backend", lambda: "cuda" if cache.offset <= 520 else None)
                cache.attention(mx.zeros((1, 4 * H, 1, D)), 0.125)
        if t == 100:
            assert mirrored._mirror_only == 100 - 40  # every row since the trim, none in the tail
            _assert_same_record(mirrored, plain)
            assert mirrored._mirror_only == 0
    assert mirrored._mirror is None and mirrored.offset == plain.offset == 524
    _assert_same_record(mirrored, plain)


def _assert_same_record(a, b):
    ra, rb = a.to_record(), b.to_record()
    assert ra.offset == rb.offset and ra.arrays.keys() == rb.arrays.keys()
    for name in ra.arrays:
        assert np.array_equal(np.array(ra.arrays[name]), np.array(rb.arrays[name])), name


def _operations(out: mx.array, tmp_path) -> int:
    """Nodes of `out`'s unevaluated graph (`mx.export_to_dot`), by primitive label."""
    path = tmp_path / "step.dot"
    mx.export_to_dot(str(path), out)
    return len(re.findall(r'label\s*=\s*"[A-Za-z]', path.read_text()))


def test_a_mirrored_decode_step_has_the_operations_of_a_raw_one(monkeypatch, tmp_path):
    """Before: each step wrote its row into the tail and then, sliced out of it, into the mirror
    (2 slice updates and 2 slices a layer more than a raw step: 1,129 against 1,097 here)."""
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    model = build_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    counts = {}
    for scheme in ("raw", "turbo5v4"):
        caches = make_prompt_cache(model, scheme)
        mx.eval(model(prompt, cache=caches))
        if scheme != "raw":
            compress_caches(caches)
        token = mx.array([[5]])
        for _ in range(3):  # past the first step, which builds the mirror
            mx.eval(model(token, cache=caches))
        counts[scheme] = _operations(model(token, cache=caches), tmp_path)
    assert counts["turbo5v4"] == counts["raw"], counts
