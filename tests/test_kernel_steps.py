"""A layer's decode step prepared once and replayed (`turboquant/attention/kernels/steps.py`), run on the
CPU through the emulator: each replayed step equals the step built from scratch, bit for bit,
across new tail rows, a block that fills (new stored rows, key means and buffers) and a trim, and
the step is rebuilt only when something it holds changes."""

import dataclasses
import gc
import math
import weakref

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention.kernels import host, steps
from turboquant.cache.compressed import TurboQuantKVCache
from kernel_support.synthetic import build_cache

from kernel_backend import force_backend
from kernel_support import emulate
from kernel_support.reference import from_scratch

pytestmark = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


def _from_scratch(q, cache, scale=0.125, causal=0):
    return from_scratch(emulate.kernel, q, cache, scale, causal)


def _bits(a):
    return np.array(a.astype(mx.float32))


# turbo4 (the default scheme) by default; turbo8v3 at bfloat16 with -m slow (the replay is the same code).
@pytest.mark.parametrize("scheme, dtype", [("turbo4", mx.float16),
                                           pytest.param("turbo8v3", mx.bfloat16, marks=pytest.mark.slow)], ids=str)
def test_replayed_steps_equal_steps_built_from_scratch(monkeypatch, scheme, dtype):
    force_backend(monkeypatch, "cuda", emulate.kernel)
    monkeypatch.setattr(steps, "TEMPLATES", {})
    described = []
    describe = host.describe
    monkeypatch.setattr(host, "describe", lambda *a, **k: described.append(1) or describe(*a, **k))
    H, D = 2, 64
    cache = build_cache(scheme, H, D, dtype, 256, seed=3, tail=253)
    k, v = (mx.random.normal((1, H, 9, D), key=mx.random.key(s)).astype(dtype) for s in (1, 2))
    # 256 + 253 rows, then across the block boundary at 512: the first step builds, two replay over
    # a growing tail (the second over a full one of 256 rows), then the rebuild, two replays, one
    # after a trim and two more
    for t in range(9):
        q = mx.random.normal((1, 4 * H, 1, D), key=mx.random.key(10 + t)).astype(dtype)
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t == 6:
            cache.trim(2)
        before = len(described)
        step = cache._steps.get("decode")
        replayed = cache.attention(q, 0.125)
        rebuilt = len(described) > before
        assert np.array_equal(_bits(replayed), _bits(_from_scratch(q, cache)[0])), t
        # built at the first step and once the rows up to 512 were encoded (t = 3: new rows, means,
        # buffers); replayed otherwise, the trim included
        assert rebuilt == (t in (0, 3)), t
        assert (cache._steps["decode"] is not step) == (t in (0, 3)), t
    assert cache.stored == 512


def test_a_question_after_a_restore_replays_the_process_template(monkeypatch):
    """Every restore makes new caches and sides, so a question after it and its first decode step
    found nothing prepared and built both calls from scratch, every layer, every restore (about
    70 us of host time a layer and call more than a raw layer's on the CPU). Calls of a shape seen
    before now come from the process's template: no `describe`, the per-side tables made once,
    and the first step takes the inputs its question filled in. The results are the calls built
    from scratch, bit for bit."""
    force_backend(monkeypatch, "cuda", emulate.kernel)
    monkeypatch.setattr(steps, "TEMPLATES", {})
    calls = {"describe": 0, "pass1_inputs": 0}
    for name in calls:
        real = getattr(host, name)
        monkeypatch.setattr(host, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a, **k))
    H, D, L = 2, 64, 5
    cache = build_cache("turbo4", H, D, mx.float16, 256, seed=3, tail=20)
    record, codecs = cache.to_record(), cache.plan.codecs()
    seen = []
    for restore in range(3):
        restored = TurboQuantKVCache.from_record(record, codecs)
        rows = mx.random.normal((1, H, L + 1, D), key=mx.random.key(restore)).astype(mx.float16)
        restored.update_and_fetch(rows[:, :, :L], rows[:, :, :L])
        question = mx.random.normal((1, 4 * H, L, D), key=mx.random.key(20 + restore)).astype(mx.float16)
        answer = restored.attention(question, 0.125, mask="causal")
        expected = _from_scratch(question, restored, causal=L)[0]
        assert np.array_equal(_bits(answer), _bits(expected)), restore
        restored.update_and_fetch(rows[:, :, L:], rows[:, :, L:])
        q = mx.random.normal((1, 4 * H, 1, D), key=mx.random.key(40 + restore)).astype(mx.float16)
        assert np.array_equal(_bits(restored.attention(q, 0.125)), _bits(_from_scratch(q, restored)[0])), restore
        seen.append(dict(calls))
        for name in calls:
            calls[name] = 0
    # Each restore's references describe twice and fill pass 1's inputs twice on their own; the
    # first restore builds both templates (a describe and pass 1's inputs each), and every
    # restore fills its question's inputs once, which its decode step takes over.
    assert seen[0] == {"describe": 2 + 2, "pass1_inputs": 2 + 2 + 1}
    assert seen[1] == seen[2] == {"describe": 2, "pass1_inputs": 2 + 1}


def test_the_per_side_tables_are_graph_nodes_not_evaluations(monkeypatch):
    """Every restore makes new sides, so a question after a restore built the kernels' per-side
    tables (query transform, pass 1's fused pre/post, the inverse value rotation, padded
    codebooks) for every layer, and each was evaluated as it was made: 10-20 ms of a 15-token
    question's forward over 8 layers on the H200 (issue 28), which now takes 7-8 ms. They are
    lazy now, evaluated with the attention call that reads them, and hold the same values."""
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=3, tail=20)
    key_side, value_side = cache._key_side, cache._value_side
    c = 0.125 * host.LOG2E
    host._constant(c, (host.MIN_INPUT_ELEMENTS,))  # (made and evaluated once per process, not per side)
    evaluated = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: evaluated.append(a) or real(*a, **k))
    kind, pre, m, post, cq = host._query_transform(key_side, c, 2, 64)
    fused_pre, fused_post = host._fused_query(key_side, c, 2, 64)
    rinv = host.inverse_matrix(value_side.codec.rotation)
    padded = host.unpooled(key_side.codec.centroids)
    assert evaluated == []
    monkeypatch.setattr(mx, "eval", real)
    rotation = key_side.codec.rotation
    eye = mx.eye(64, dtype=mx.float32)
    assert kind == "pass0" and np.array_equal(np.array(m), np.array(rotation.forward(eye)))
    assert np.array_equal(np.array(rinv), np.array(value_side.codec.rotation.inverse(eye)))
    assert np.array_equal(np.array(cq)[0], np.float32(c))
    centroids = np.array(key_side.codec.centroids)
    assert np.array_equal(np.array(padded)[:centroids.size], centroids.reshape(-1))
    assert np.array_equal(np.array(fused_pre), np.array(pre * rotation.signs.astype(mx.float32) / 8.0))
    assert fused_post.shape == (2, 64) and (post is None) == bool(np.all(np.array(fused_post) == 1))


def test_a_prepared_step_calls_the_kernel_objects_it_bound(monkeypatch):
    """A prepared step asks each kernel once for the object to launch (`CachedKernel.bound`: its
    module made sure of on disk for that dtype signature) and replays call that object itself,
    with inputs of exactly the dtypes it was bound for (pass 2's partials are pass 1's outputs),
    never the per-launch signature check of `CachedKernel.__call__`."""
    bound, checked, launched = [], [], []

    class Bindable:
        def __init__(self, variant):
            self.inner = emulate.kernel(variant)

        def __call__(self, **launch):
            checked.append(launch)
            return self.inner(**launch)

        def bound(self, input_dtypes, output_dtypes):
            slot = len(bound)
            bound.append((list(input_dtypes), list(output_dtypes)))

            def launch(*, inputs, output_dtypes, **rest):
                launched.append((slot, [a.dtype for a in inputs], list(output_dtypes)))
                return self.inner(inputs=inputs, output_dtypes=output_dtypes, **rest)
            return launch

    force_backend(monkeypatch, "cuda", Bindable)
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=3, tail=20)
    for t in range(3):
        row = mx.random.normal((1, 2, 1, 64), key=mx.random.key(t)).astype(mx.float16)
        cache.update_and_fetch(row, row)
        q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(10 + t)).astype(mx.float16)
        mx.eval(cache.attention(q, 0.125))
    assert len(bound) == 2 and checked == []
    assert len(launched) == 6
    for slot, input_dtypes, output_dtypes in launched:
        assert (input_dtypes, output_dtypes) == bound[slot]


def test_sides_of_one_codec_share_its_tables():
    """The rotation matrix depends on the codec alone, but was made for each side: every layer
    of every restore made it again (a restore from memory now reuses its codecs). Sides of one
    codec share it; what the calibration sets stays per side."""
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=3)
    other = build_cache("turbo4", 2, 64, mx.float16, 256, seed=5)
    c = 0.125 * host.LOG2E
    first = cache._key_side
    second = cache.active.key.side("keys", other.calibration)
    assert second.codec is first.codec
    _, pre1, m1, post1, _ = host._query_transform(first, c, 2, 64)
    _, pre2, m2, post2, _ = host._query_transform(second, c, 2, 64)
    assert m1 is m2 and host._fused_query(first, c, 2, 64)[0] is not host._fused_query(second, c, 2, 64)[0]
    assert not np.array_equal(np.array(pre1), np.array(pre2)) and not np.array_equal(np.array(post1), np.array(post2))


def test_the_fused_query_divides_by_sqrt_d_as_before_at_head_dim_128():
    """The fused query's pre is (pre * signs) / sqrt(d), bit for bit: folding 1/sqrt(d) into the
    codec's sign table (6bcc133) changed about 40% of its values by an ulp at d = 128, where
    sqrt(d) is not a power of two."""
    cache = build_cache("turbo4", 2, 128, mx.float16, 256, seed=3)
    c = 0.088 * host.LOG2E
    _, pre, _, _, _ = host._query_transform(cache._key_side, c, 2, 128)
    fused_pre, _ = host._fused_query(cache._key_side, c, 2, 128)
    signs = cache._key_side.codec.rotation.signs.astype(mx.float32)
    assert np.array_equal(np.array(fused_pre), np.array(pre * signs / math.sqrt(128)))


def test_the_per_side_tables_stay_bounded_and_let_old_sides_go():
    """Every restore from LMDB or S3 makes new calibrations, and the tables made for them were kept
    forever with their side: a long-running server grew by every layer's tables (a 64 KB rotation
    matrix among them at head dim 128) at each restore. The tables are bounded now, oldest first,
    and what they dropped is freed."""
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=3)
    c = 0.125 * host.LOG2E
    first = cache.active.key.side("keys", dataclasses.replace(cache.calibration))
    host._query_transform(first, c, 2, 64)
    host._fused_query(first, c, 2, 64)
    watched, calibration = weakref.ref(first), weakref.ref(first.calibration)
    del first
    for _ in range(host.TABLES_KEPT):
        host._query_transform(cache.active.key.side("keys", dataclasses.replace(cache.calibration)), c, 2, 64)
    assert len(host._QT) <= host.TABLES_KEPT
    gc.collect()
    assert watched() is None and calibration() is None


def test_restores_share_their_calibration_and_its_query_tables():
    """A restore made a new calibration for every layer (a float32 copy of the stored arrays), so
    the query tables made from it (pre, post, the fused query's pre: graph nodes for the device)
    were made again by each layer of each restore. Restores of the same stored arrays (the
    memory tier hands out the same ones) now share the calibration and its tables; other
    arrays get their own."""
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=3)
    other = build_cache("turbo4", 2, 64, mx.float16, 256, seed=5)
    record, codecs = cache.to_record(), cache.plan.codecs()
    a, b = (TurboQuantKVCache.from_record(record, codecs) for _ in range(2))
    c = TurboQuantKVCache.from_record(other.to_record(), codecs)
    assert a._key_side is not b._key_side and a._key_side.calibration is b._key_side.calibration
    assert c._key_side.calibration is not a._key_side.calibration
    scale = 0.125 * host.LOG2E
    assert host._fused_query(a._key_side, scale, 2, 64) is host._fused_query(b._key_side, scale, 2, 64)
    assert host._query_transform(a._key_side, scale, 2, 64) is host._query_transform(b._key_side, scale, 2, 64)
    assert host._fused_query(c._key_side, scale, 2, 64) is not host._fused_query(a._key_side, scale, 2, 64)
    stored = cache.calibration.arrays()
    assert all(np.array_equal(np.array(v), np.array(stored[k]))
               for k, v in a._key_side.calibration.arrays().items())
