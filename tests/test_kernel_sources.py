"""The fused decode kernels without a GPU: source generation for every variant and both
dialects, backend selection and the attention hook's fallback, the Metal self-check, and the
kernels themselves run on the CPU through the emulator (one OS thread per GPU thread)."""

import itertools
import math
import re
import shutil
import subprocess
import warnings

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels import KernelTuning, host, metal, steps
from turboquant.attention.kernels import dialects, merge
from turboquant.attention.kernels import template as tpl
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.cuda import translation_unit
from turboquant.attention.kernels.ragged import Ragged
from turboquant.attention.kernels.mma import MmaPass1
from kernel_support.synthetic import build_cache, stored, tail
from turboquant.codec.sides import NativeSide

from kernel_backend import force_backend
from kernel_support import emulate, on_demand
from kernel_support.reference import reference

D_VALUES = (64, 80, 96, 128, 256)


def all_variants():
    """Every pass-1 structure the layouts can produce (rows bucket 4), plus every rows bucket at
    d=128, and every pass-0 and pass-2 variant."""
    sides = []
    for dt in tpl.NATIVE_DTYPES:
        sides.append(("native", 0, 0, dt))
    for bits, group, dt in itertools.product(tpl.AFFINE_BITS, tpl.AFFINE_GROUPS, tpl.NATIVE_DTYPES):
        sides.append(("affine", bits, group, dt))
    for bits in tpl.TURBO_BITS:
        sides.append(("turbo", bits, 0, ""))
    out = []
    for d in D_VALUES:
        for (kf, kb, kg, kd), (vf, vb, vg, vd) in itertools.product(sides, sides):
            if vf == "native" or (kf == "affine" and d % kg) or (vf == "affine" and d % vg):
                continue
            if vf == "affine" and (vb, vg, vd) != (kb, kg, kd) and kf == "affine":
                continue  # affine layouts use one codec for both sides
            for shifts in ((False, True) if kf != "native" else (False,)):
                for rmax in (tpl.ROW_BUCKETS if d == 128 else (4,)):
                    raw = kf != "turbo" or not d & (d - 1)  # turbo keys: a Hadamard butterfly in pass 1
                    for q_dtype in ("",) + (tpl.NATIVE_DTYPES if raw and rmax == 4 else ()):
                        out.append(tpl.Pass1(d=d, key=kf, key_bits=kb, key_group=kg, key_dtype=kd, value=vf,
                                             value_bits=vb, value_group=vg, value_dtype=vd, rmax=rmax,
                                             shifts=shifts, q_dtype=q_dtype))
        out += [Pass2(d=d, rotate=True), Pass2(d=d, rotate=False)]
        out += [Pass0(d=d, q_dtype=dt, post=post, qs=qs) for dt in tpl.NATIVE_DTYPES
                for post in (False, True) for qs in (False, True)]
    return out


VARIANTS = all_variants()


def test_every_variant_generates_both_dialects_in_step():
    names = set()
    for v in VARIANTS:
        assert v.name not in names
        names.add(v.name)
        bodies = {}
        for dialect in dialects.DIALECTS:
            header, body = tpl.source(v, dialect)
            text = header + body
            assert not dialects.leftover_markers(text), (v.name, dialect, dialects.leftover_markers(text)[:3])
            assert text.count("{") == text.count("}"), (v.name, dialect)
            assert text.count("(") == text.count(")"), (v.name, dialect)
            assert body.startswith("\n") and dialects.PROLOGUE[dialect] in body
            bodies[dialect] = body.replace(dialects.PROLOGUE[dialect], "<prologue>")
        # One template: the two bodies differ only in how they read their thread indices.
        assert bodies["cuda"] == bodies["metal"], v.name
    assert len(names) > 1000


def test_dialect_headers_and_prologues():
    cuda, metal_ = dialects.HEADERS["cuda"], dialects.HEADERS["metal"]
    for token in ("__shfl_xor_sync", "__shared__", "__syncthreads", "__funnelshift_r"):
        assert token in cuda and token not in metal_
    for token in ("simd_shuffle_xor", "threadgroup_barrier", "threadgroup const float", "as_type<"):
        assert token in metal_ and token not in cuda
    for macro in ("DEV", "TGMEM", "SYNC", "SHFL_XOR", "EXP2", "LOG2", "FMAX", "IMIN", "AS_FLOAT", "NEG_INF",
                  "CBLOOK", "U2", "U4"):
        for header in (cuda, metal_, emulate.HEADER):
            assert re.search(rf"#define {macro}\b|struct {macro}\b", header), (macro, header[:40])
    assert "threadIdx" in dialects.PROLOGUE["cuda"] and "blockIdx" in dialects.PROLOGUE["cuda"]
    # Metal adds an attribute argument only for names that appear in the body itself.
    assert "thread_position_in_threadgroup" in dialects.PROLOGUE["metal"]
    assert "threadgroup_position_in_grid" in dialects.PROLOGUE["metal"]


def test_runtime_sizes_are_not_compiled_in():
    """T, span, blocks and R come from `params`; the name and source of a variant never change
    with them (one compile per model layout, not per step)."""
    v = tpl.Pass1(d=128, key="turbo", key_bits=4, key_group=0, key_dtype="", value="turbo", value_bits=3,
                  value_group=0, value_dtype="", rmax=4, shifts=True)
    body = tpl.source(v, "cuda")[1]
    for size in ("T", "span", "nblk", "R", "H", "NG"):
        assert re.search(rf"const int {size} = params\[\d\];", body)
    assert "q_s" in v.input_names() and "mu" in v.input_names()


def test_names_carry_dtypes_and_structure():
    base = dict(d=128, key="native", key_bits=0, key_group=0, value="turbo", value_bits=4, value_group=0,
                value_dtype="", rmax=4, shifts=False)
    names = {tpl.Pass1(key_dtype=dt, **base).name for dt in tpl.NATIVE_DTYPES}
    assert len(names) == 3
    with pytest.raises(ValueError):
        tpl.Pass1(key_dtype="float16", **{**base, "d": 84})
    with pytest.raises(ValueError):
        tpl.Pass1(key_dtype="float16", **{**base, "shifts": True})


@pytest.mark.parametrize("d", D_VALUES)
@pytest.mark.parametrize("rmax", tpl.ROW_BUCKETS)
def test_lane_shape_covers_the_head_dim(d, rmax):
    ns, g = tpl.lane_shape(d, rmax)
    assert g & (g - 1) == 0 and g <= 32 and g * ns * 8 >= d
    assert rmax * ns * 8 <= 64 or ns == 1


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 255, 256, 4096, 70000, 131072, 1 << 20, 4 << 20])
@pytest.mark.parametrize("rows", [1, 2, 8, 64])
def test_block_plan_covers_every_token(T, rows):
    plan = host.plan_blocks(T, rows)
    assert plan is not None
    span, nblk = plan
    assert (nblk - 1) * span < T <= nblk * span
    assert nblk <= merge.MAX_BLOCKS and span <= tpl.MAX_SPAN
    assert nblk <= max(-(-T // host.MIN_SPAN), -(-T // tpl.MAX_SPAN))
    # a block touches at most MAX_SHIFT_BLOCKS key-mean blocks (what pass 1 keeps in its buffer)
    assert span // 256 + 2 <= tpl.MAX_SHIFT_BLOCKS
    assert host.plan_blocks(merge.MAX_BLOCKS * tpl.MAX_SPAN + 1, rows) is None


@pytest.mark.parametrize("target", [264, 396, 528])
def test_block_plan_never_exceeds_the_threadgroup_target(target):
    """The target is a wave of the GPU: 8 KV heads at 396 once planned 50 blocks each (400
    threadgroups), and the four past the wave made a second one."""
    for rows in (1, 8, 16):
        span, nblk = host.plan_blocks(65536, rows, target)
        assert nblk * rows <= target
        assert nblk * rows >= 0.9 * target
    assert host.plan_blocks(65536, 32, target)[1] == 65536 // tpl.MAX_SPAN  # longest blocks win


def test_selection_on_cpu_returns_none(monkeypatch):
    assert mx.default_device().type == mx.DeviceType.cpu
    assert kernels.select_backend() is None
    cache = build_cache("turbo4", 2, 64, mx.float32, 40)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    assert kernels.fused_decode(q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts) is None
    monkeypatch.setenv("TQSTORE_KERNELS", "0")
    assert kernels.select_backend() is None


def test_describe_rejects_what_no_kernel_reads():
    cache = build_cache("turbo4", 2, 64, mx.float32, 40)
    ks, vs, arrays = cache._key_side, cache._value_side, stored(cache)
    q = mx.zeros((1, 4, 1, 64))
    assert host.describe(q, ks, vs, arrays, cache._shifts) is not None
    assert host.describe(mx.zeros((1, 4, 2, 64)), ks, vs, arrays, cache._shifts) is None  # L != 1
    assert host.describe(mx.zeros((1, 3, 1, 64)), ks, vs, arrays, cache._shifts) is None  # 3 q heads, 2 kv
    assert host.describe(q, ks, vs, {}, None) is None
    assert host.describe(q, ks, vs, arrays, cache._shifts[:, :0]) is None  # too few key means
    assert host.describe(q, ks, NativeSide("values"), arrays, None) is None  # native values
    assert host.describe(q, ks, NativeSide("missing"), arrays, None) is None
    assert host.describe(mx.zeros((1, 4, 1, 32)), ks, vs, arrays, cache._shifts) is None  # head dim


needs_cxx = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


@needs_cxx
def test_hook_merges_the_tail_exactly(monkeypatch):
    """compressed_attention through the kernel (emulated) and merge_tail equals the f64 reference
    over [stored | tail], and the kernel is not used where it must not be."""
    cache = build_cache("turbo3", 2, 64, mx.float16, 256, seed=3, tail=37)
    assert tail(cache) is not None and cache.stored == 256
    calls = []

    def factory(v):
        calls.append(v)
        return emulate.kernel(v)

    force_backend(monkeypatch, "cuda", factory, tuning=KernelTuning(mma_min_tokens=0))
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(1)).astype(mx.float16)
    ref, _ = reference(cache, q, 0.125)
    for mask in (None, "causal"):
        calls.clear()
        cache._steps.clear()  # (a kept step replays its kernels: test_kernel_steps.py)
        steps.TEMPLATES.clear()  # (and so does the process's template of the same call shape)
        out = cache.attention(q, 0.125, mask)
        assert len(calls) == 2 and out.dtype == mx.float16  # pass 1 (rotates the query), pass 2
        assert isinstance(calls[0], MmaPass1)  # fp16 activations on CUDA: the tensor-core pass 1
        assert calls[1].tail_dtype == "float16"  # pass 2 attends over the raw tail too
        assert calls[1].out_dtype == "float16"  # and writes the output in the activation dtype
        err = np.abs(np.array(out.astype(mx.float32)) - ref).max()
        assert err <= 2.0**-10 * np.abs(ref).max() * 2 + 1e-4 * np.abs(ref).max()
    calls.clear()
    with pytest.raises(ValueError):
        cache.attention(q, 0.125, "sliding")
    cache.attention(q, 0.125, mx.ones((1, cache.offset), dtype=mx.bool_))  # array mask: plain ops
    assert calls == []  # (L > 1: test_kernel_prefill.py)


@needs_cxx
def test_decode_step_reads_the_cache_buffers_in_place(monkeypatch):
    """A decode step hands the kernels the cache's own buffers (capacity beyond the rows that
    count), the query as it comes and one dense key-mean table per table object: no slicing,
    reshaping or copying op joins each step's graph, and the result is unchanged."""
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=9, tail=44)
    assert cache.stored == 256 and cache.offset == 300
    seen = []

    def factory(v):
        run = emulate.kernel(v)

        def call(**kw):
            seen.append((v, kw["inputs"]))
            return run(**kw)
        return call

    force_backend(monkeypatch, "cuda", factory)
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(4)).astype(mx.float16)
    ref, _ = reference(cache, q, 0.125)
    out = cache.attention(q, 0.125)
    assert out.dtype == mx.float16 and out.shape == (1, 8, 1, 64)
    assert np.abs(np.array(out.astype(mx.float32)) - ref).max() <= 2e-3 * np.abs(ref).max()
    handed = {id(a) for _, inputs in seen for a in inputs}
    buffers = [*cache._store.arrays.values(), cache._tail.arrays["keys"], cache._tail.arrays["values"]]
    assert all(id(b) in handed for b in buffers)
    assert cache._tail.arrays["keys"].shape[2] > 44  # the tail buffer: room beyond its 44 rows
    pass2 = [inputs for v, inputs in seen if isinstance(v, Pass2)][0]
    assert any(a is q for a in pass2)  # the tail's scores read the query through its strides
    mu = [inputs[v.input_names().index("mu")] for v, inputs in seen if isinstance(v, tpl.Pass1)]
    seen.clear()
    cache.attention(q, 0.125)
    again = [inputs[v.input_names().index("mu")] for v, inputs in seen if isinstance(v, tpl.Pass1)]
    assert again[0] is mu[0]  # the dense key means are made once per table


def test_hook_falls_back_when_no_kernel_applies(monkeypatch):
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    cache = build_cache("turbo0v4", 2, 64, mx.float32, 40)
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(4))
    monkeypatch.setattr(host, "describe", lambda *a, **k: None)
    expected, _ = reference(cache, q, 0.125)
    out = np.array(cache.attention(q, 0.125))
    assert np.abs(out - expected).max() <= 1e-4 * np.abs(expected).max()


def _ref_check(cache, q, scale, out, lse, rtol=1e-5):
    ref_out, ref_lse = reference(cache, q, scale, with_tail=False)
    out = np.array(out).astype(np.float64)
    lse = np.array(lse).astype(np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
    assert err <= rtol, err
    assert np.abs(lse - ref_lse).max() <= rtol * max(1.0, np.abs(ref_lse).max())
    return err


# (scheme, H, R, D, T, dtype): each layout, head dim, bits, rows bucket and dtype at least once
EMULATED = [
    ("turbo0v4", 2, 1, 128, 1, mx.float16),
    ("turbo0v3", 1, 7, 80, 63, mx.bfloat16),
    ("turbo0v2", 2, 4, 96, 65, mx.float32),
    ("turbo8v3", 2, 2, 128, 65, mx.float16),
    ("turbo8v4", 1, 7, 96, 300, mx.bfloat16),
    ("turbo8v2", 2, 1, 64, 1, mx.float32),
    ("turbo3", 2, 4, 256, 200, mx.float32),
    ("turbo2", 1, 2, 80, 70, mx.float16),
    ("turbo4v2", 2, 7, 64, 513, mx.bfloat16),
    ("affine8", 2, 4, 128, 130, mx.float16),
    ("affine4", 1, 2, 96, 64, mx.bfloat16),
    ("affine4", 2, 1, 256, 64, mx.float32),
    ("turbo4", 1, 16, 64, 65, mx.float32),
]


@needs_cxx
@pytest.mark.parametrize("case", on_demand(EMULATED, {1, 3, 10, 12}), ids=lambda c: f"{c[0]}-H{c[1]}R{c[2]}d{c[3]}T{c[4]}")
def test_emulated_kernel_matches_f64_reference(case):
    scheme, H, R, D, T, dtype = case
    cache = build_cache(scheme, H, D, dtype, T, seed=T + D)
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(D)).astype(dtype)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
    assert call is not None
    args = (call, q, cache._key_side, cache._value_side, stored(cache), 1 / math.sqrt(D), cache._shifts)
    # The emulator fills every output with NaN first: no NaN left means every element was written.
    out, lse, po, pm, pl = host.launch(emulate.kernel, *args, init_value=float("nan"), partials=True)
    assert not any(mx.any(mx.isnan(a)).item() for a in (po, pm, pl))
    _ref_check(cache, q, 1 / math.sqrt(D), out, lse)
    again = host.launch(emulate.kernel, *args)
    assert mx.array_equal(again[0], out).item() and mx.array_equal(again[1], lse).item()


@needs_cxx
@pytest.mark.parametrize("scheme,dtype", on_demand([("turbo8v3", mx.float16), ("turbo0v4", mx.bfloat16),
                                                    ("affine8", mx.float32)], {1}, unpack=True))
def test_emulated_pass1_scales_the_raw_query(scheme, dtype):
    """Keys without a rotation, with and without key means: pass 1 reads the activation-dtype
    query itself (no pass-0 kernel or query op), through a non-contiguous view."""
    q = mx.random.normal((1, 1, 6, 96), key=mx.random.key(6)).astype(dtype).swapaxes(1, 2)
    for calibrated in (False, True):
        cache = build_cache(scheme, 2, 96, dtype, 130, seed=4, calibrated=calibrated)
        call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
        names = call.pass1.input_names()
        assert call.pass1.q_dtype == host.DTYPE_NAMES[dtype] and "q_raw" in names and "q_k" not in names
        assert ("mu" in names) == (cache._shifts is not None)
        out, lse = host.launch(emulate.kernel, call, q, cache._key_side, cache._value_side, stored(cache),
                               1 / math.sqrt(96), cache._shifts)
        _ref_check(cache, q, 1 / math.sqrt(96), out, lse)


@needs_cxx
@pytest.mark.parametrize("scheme,D,R,dtype", on_demand([("turbo4", 128, 4, mx.float16),
                                                        ("turbo3", 64, 7, mx.bfloat16),
                                                        ("turbo2", 256, 1, mx.float32)], {2}, unpack=True))
def test_emulated_pass1_rotates_the_raw_query(scheme, D, R, dtype):
    """TurboQuant keys under a Hadamard rotation (d a power of two): pass 1 stages the raw query
    and applies signs, butterfly and channel scales itself, with and without key means, so a
    step runs no pass-0 kernel; `fuse_rotation` off (and d = 96) keeps pass 0. All match f64."""
    q = mx.random.normal((1, 2 * R, 1, D), key=mx.random.key(R)).astype(dtype)
    for calibrated, fuse in ((True, True), (False, True), (True, False)):
        cache = build_cache(scheme, 2, D, dtype, 200, seed=D, calibrated=calibrated)
        call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts,
                             tuning=KernelTuning(fuse_rotation=fuse))
        launched = []

        def factory(v):
            launched.append(v)
            return emulate.kernel(v)

        out, lse = host.launch(factory, call, q, cache._key_side, cache._value_side, stored(cache),
                               1 / math.sqrt(D), cache._shifts)
        assert any(isinstance(v, Pass0) for v in launched) is not fuse
        assert (call.pass1.q_dtype == host.DTYPE_NAMES[dtype]) is fuse
        _ref_check(cache, q, 1 / math.sqrt(D), out, lse)
    cache = build_cache(scheme, 2, 96, dtype, 50, seed=1)
    q96 = mx.random.normal((1, 2, 1, 96), key=mx.random.key(1)).astype(dtype)
    assert host.describe(q96, cache._key_side, cache._value_side, stored(cache), cache._shifts).pass1.q_dtype == ""


# (scheme, H, R, D, stored T, tail rows, dtype): rotated and affine values, every dtype, one to
# 255 tail rows (stored rows end on a block boundary, so the newer rows stay raw), CUDA-core and
# tensor-core pass 1
TAILS = [
    ("turbo4", 2, 4, 128, 512, 77, mx.float16),
    ("turbo8v3", 1, 7, 64, 256, 1, mx.bfloat16),
    ("turbo0v2", 2, 2, 96, 256, 255, mx.float32),
    ("affine8", 2, 1, 128, 256, 130, mx.float16),
]


@needs_cxx
@pytest.mark.parametrize("case", on_demand(TAILS, {0}), ids=lambda c: f"{c[0]}-R{c[2]}d{c[3]}T{c[4]}+{c[5]}")
def test_emulated_pass2_attends_over_the_raw_tail(case):
    """Pass 2 with the raw tail equals the f64 reference over [stored | tail] and the plain-ops
    merge of the same stored rows; every output is written."""
    scheme, H, R, D, T, n, dtype = case
    cache = build_cache(scheme, H, D, dtype, T, seed=n, tail=n)
    assert tail(cache) is not None and tail(cache)[0].shape[2] == n
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(n)).astype(dtype)
    arrays = stored(cache)
    call = host.describe(q, cache._key_side, cache._value_side, arrays, cache._shifts,
                         tensor_cores=dtype != mx.float32, tuning=KernelTuning(mma_min_tokens=0))
    args = (call, q, cache._key_side, cache._value_side, arrays, 1 / math.sqrt(D), cache._shifts)
    calls = []

    def factory(v):
        calls.append(v)
        return emulate.kernel(v)

    out, lse = host.launch(factory, *args, init_value=float("nan"), tail=tail(cache))
    assert calls[-1].tail_dtype == str(dtype).split(".")[-1]
    merged = host.launch(emulate.kernel, *args, tail=tail(cache), fuse_tail=False)
    ref_out, ref_lse = reference(cache, q, 1 / math.sqrt(D))
    rtol = 2e-3 if dtype != mx.float32 else 1e-5
    for o, l in ((out, lse), merged):
        o = np.array(o).astype(np.float64)
        assert np.isfinite(o).all()
        assert np.abs(o - ref_out).max() <= rtol * np.abs(ref_out).max()
        assert np.abs(np.array(l) - ref_lse).max() <= rtol * max(1.0, np.abs(ref_lse).max())


@needs_cxx
@pytest.mark.parametrize("scheme", on_demand(["turbo2", "turbo8v3"], {1}))
def test_no_kernel_input_is_small_enough_for_the_scalar_pool(scheme):
    """MLX's CUDA allocator keeps arrays of up to 8 bytes in a managed-memory pool; a kernel that
    read a one-float input there took 9.2 instead of 3.6 us on the H200. Every input of every
    pass (pass 0 with key means, the raw query with key means, a 2-bit codebook, pass 2 over a
    raw tail) is padded well past it."""
    cache = build_cache(scheme, 2, 64, mx.float16, 256, seed=3, tail=5)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(2)).astype(mx.float16)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
    sizes = {}

    def factory(v):
        run = emulate.kernel(v)

        def record(**kw):
            sizes.update({f"{v.name}:{n}": a.nbytes for n, a in zip(v.input_names(), kw["inputs"])
                          if a is not None})
            return run(**kw)
        return record

    host.launch(factory, call, q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts,
                tail=tail(cache))
    assert any(n.endswith(":cq") for n in sizes) and cache._shifts is not None
    small = {n: b for n, b in sizes.items() if b < 4 * host.MIN_INPUT_ELEMENTS}
    assert not small, small


@needs_cxx
def test_emulated_uncalibrated_turbo_and_strided_views():
    """Plain turbo layout (no key means), and arrays read through their strides: the cache hands
    out token slices of larger buffers."""
    cache = build_cache("turbo4", 2, 64, mx.float32, 100, calibrated=False)
    assert cache._shifts is None
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(9))
    arrays = stored(cache)
    # a view: the first 70 tokens of 100 (non-contiguous along heads)
    view = {n: a[:, :, :70] for n, a in arrays.items()}
    call = host.describe(q, cache._key_side, cache._value_side, view, None)
    # the emulator copies inputs to contiguous arrays; strides still differ per array kind
    out, lse = host.launch(emulate.kernel, call, q, cache._key_side, cache._value_side, view, 0.125, None)
    ref_out, ref_lse = host.plain_decode(q, cache._key_side, cache._value_side, view, 0.125, None)
    assert np.abs(np.array(out) - np.array(ref_out)).max() <= 1e-5 * np.abs(np.array(ref_out)).max()


@needs_cxx
def test_metal_self_check_keeps_a_good_kernel_and_drops_a_bad_one(monkeypatch):
    metal.reset()
    cache = build_cache("turbo8v3", 2, 64, mx.float16, 90)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5)).astype(mx.float16)
    args = (q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts)
    refs = []
    real_plain = host.plain_decode

    def counting_plain(*a):
        refs.append(1)
        return real_plain(*a)

    monkeypatch.setattr(host, "plain_decode", counting_plain)
    force_backend(monkeypatch, "metal", emulate.kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = kernels.fused_decode(*args)
        second = kernels.fused_decode(*args)
    assert first is not None and second is not None and len(refs) == 1  # checked once per shape

    class Broken:
        def __init__(self, v):
            self.inner = emulate.kernel(v)
            self.v = v

        def __call__(self, **kw):
            outs = self.inner(**kw)
            return [outs[0] * 1.1, *outs[1:]] if isinstance(self.v, Pass2) else outs

    metal.reset()
    force_backend(monkeypatch, "metal", Broken)
    with pytest.warns(RuntimeWarning, match="disagrees with the plain-ops path"):
        assert kernels.fused_decode(*args) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.fused_decode(*args) is None  # verdict cached: no second warning
        out = cache.attention(q, 0.125)  # the hook falls back to plain ops
    ref, _ = reference(cache, q, 0.125)
    assert np.abs(np.array(out.astype(mx.float32)) - ref).max() <= 2e-3 * np.abs(ref).max()
    metal.reset()


nvcc = shutil.which("nvcc")


# nvcc on 2 cores (30 s and 6 s): on demand and on the GPU machine; the default run pins the
# generated text byte for byte instead (tests/test_kernel_digests.py).
@pytest.mark.slow
@pytest.mark.skipif(nvcc is None, reason="needs nvcc")
def test_cuda_sources_compile(tmp_path):
    """A representative set compiles for sm_90 as MLX assembles it (a stand-in device header)."""
    picks = [v for v in VARIANTS if isinstance(v, Pass2)][:4]
    picks += [Pass2(d=d, rotate=rot, tail_dtype=dt, q_dtype=dt) for d, rot in ((128, True), (80, False))
              for dt in tpl.NATIVE_DTYPES]
    picks += [v for v in VARIANTS if isinstance(v, Pass0) and v.d in (80, 128)][::3]
    seen = set()
    for v in VARIANTS:
        if isinstance(v, tpl.Pass1):
            key = (v.key, v.key_bits if v.key != "affine" else 0, v.value, v.key_dtype[:2], v.d in (80, 96),
                   v.q_dtype == "bfloat16")
            if key not in seen:
                seen.add(key)
                picks.append(v)
    picks += [Pass2(d=128, rotate=True, tail_dtype=dt, q_dtype=dt, out_dtype=dt) for dt in ("float16", "bfloat16")]
    picks += [Pass2(d=80, rotate=False, out_dtype="float16")]
    picks += [Ragged(128, 8, 4, 8, dt, 128 ** -0.5) for dt in tpl.NATIVE_DTYPES] + [Ragged(80, 2, 7, 8, "float16", 0.1)]
    src = tmp_path / "kernels.cu"
    src.write_text("\n".join(translation_unit(v) for v in picks))
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
