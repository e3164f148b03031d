"""Attention sinks (gpt-oss) in the fused decode without a GPU: pass 2's sink variant in both
dialects and under nvcc, and the kernels run on the CPU through the emulator against the float64
softmax with the sink in the normaliser (CUDA-core and tensor-core pass 1, the raw tail merged in
pass 2 or with plain ops, the Metal self-check). sinks=None must run exactly what ran before."""

import itertools
import math
import shutil
import subprocess
import warnings

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels import KernelTuning, dialects, host, metal
from turboquant.attention.kernels import template as tpl
from turboquant.attention.kernels.cuda import translation_unit
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.mma import MmaPass1
from kernel_support.synthetic import build_cache, stored, tail

from kernel_backend import force_backend
from kernel_support import emulate, on_demand
from kernel_support.reference import reference

needs_cxx = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


def pass2_variants(sinks: bool) -> list[Pass2]:
    out = []
    for d, rotate, td, od in itertools.product((64, 80, 96, 128, 256), (True, False), ("",) + tpl.NATIVE_DTYPES,
                                              ("", "float16", "bfloat16")):
        out.append(Pass2(d=d, rotate=rotate, tail_dtype=td, q_dtype=td, out_dtype=od, sinks=sinks))
    return out


def test_sink_variants_generate_both_dialects_and_differ_only_in_the_normaliser():
    names = set()
    for plain, sink in zip(pass2_variants(False), pass2_variants(True)):
        assert sink.name == plain.name + "_sk" and sink.name not in names
        names.add(sink.name)
        assert sink.input_names() == plain.input_names() + ["sinks"]
        for dialect in dialects.DIALECTS:
            header, body = tpl.source(sink, dialect)
            assert not dialects.leftover_markers(header + body)
            assert header == tpl.source(plain, dialect)[0]
            # the one difference: the sink joins M and L where the plain merge takes 1 / L
            plain_body = body.replace(dialects.section("pass2.h", "sink"), "const float inv = 1.0f / L;")
            assert plain_body == tpl.source(plain, dialect)[1]
        assert tpl.source(sink, "cuda")[1].replace(dialects.PROLOGUE["cuda"], "") == \
            tpl.source(sink, "metal")[1].replace(dialects.PROLOGUE["metal"], "")
        assert "sinks" not in tpl.source(plain, "cuda")[1]


def _sinks(cache, q, scale, offsets, dtype=mx.float32) -> mx.array:
    """One sink per query head at its head's own log-sum-exp plus an offset: a sink of a
    noticeable weight (e^o / (1 + e^o) of the normaliser), not one lost in rounding."""
    _, lse = reference(cache, q, scale)
    lse = lse.reshape(-1)
    return mx.array([lse[i] + offsets[i % len(offsets)] for i in range(lse.size)]).astype(dtype)


def _close(out, lse, ref_out, ref_lse, rtol):
    out = np.array(out.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(out).all() and np.isfinite(np.array(lse)).all()
    err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
    # each head's lse against its own size (the +1000 sinks' would hide the others')
    lerr = (np.abs(np.array(lse) - ref_lse) / np.maximum(1.0, np.abs(ref_lse))).max()
    assert err <= rtol and lerr <= rtol, (err, lerr)


# (scheme, H, R, D, stored T, tail rows, dtype, tensor cores): CUDA-core pass 1 in float32 (held
# to 1e-5 like the kernel without sinks), tensor-core pass 1 (fp16 products: 2e-3), rotated and
# affine values, GQA 1 to 7, no tail, a tail in pass 2
CASES = [
    ("turbo4", 2, 4, 64, 300, 0, mx.float32, False),
    ("affine8", 2, 1, 128, 130, 0, mx.float32, False),
    ("turbo0v3", 1, 7, 96, 256, 40, mx.float32, False),
    ("turbo8v3", 2, 4, 128, 512, 0, mx.float16, True),
    ("turbo3", 2, 2, 64, 256, 77, mx.bfloat16, True),
]
OFFSETS = (-3.0, 0.0, 2.0, 1000.0, -1000.0)  # light, equal, heavy, all of it, none of it


@needs_cxx
@pytest.mark.parametrize("case", on_demand(CASES, {1, 3, 4}), ids=lambda c: f"{c[0]}-R{c[2]}d{c[3]}T{c[4]}+{c[5]}-mma{int(c[7])}")
def test_emulated_decode_with_sinks_matches_f64_softmax_with_the_sink(case):
    scheme, H, R, D, T, n, dtype, mma = case
    cache = build_cache(scheme, H, D, dtype, T, seed=T + n, tail=n)
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(D + R)).astype(dtype)
    scale = 1 / math.sqrt(D)
    sinks = _sinks(cache, q, scale, OFFSETS, mx.bfloat16 if dtype == mx.bfloat16 else mx.float32)
    arrays, t = stored(cache), tail(cache)
    assert (t is not None) == (n > 0)
    call = host.describe(q, cache._key_side, cache._value_side, arrays, cache._shifts, tensor_cores=mma,
                         tuning=KernelTuning(mma_min_tokens=0))
    assert isinstance(call.pass1, MmaPass1) == mma
    launched = []

    def factory(v):
        launched.append(v)
        return emulate.kernel(v)

    args = (call, q, cache._key_side, cache._value_side, arrays, scale, cache._shifts)
    out, lse = host.launch(factory, *args, init_value=float("nan"), tail=t, sinks=sinks)
    p2 = launched[-1]
    assert p2.sinks and "sinks" in p2.input_names() and bool(p2.tail_dtype) == (t is not None)
    ref_out, ref_lse = reference(cache, q, scale, sinks=sinks)
    rtol = 2e-3 if mma else 1e-5
    _close(out, lse, ref_out, ref_lse, rtol)
    # a sink 1000 above the scores takes all the weight (no overflow), 1000 below none
    heads = np.array(out.astype(mx.float32)).reshape(H * R, D)
    assert H * R <= 3 or np.abs(heads[3::len(OFFSETS)]).max() <= 1e-30
    # the raw tail merged with plain ops (Metal's route) keeps the sink in the normaliser
    if t is not None:
        merged = host.launch(emulate.kernel, *args, tail=t, fuse_tail=False, sinks=sinks)
        _close(*merged, ref_out, ref_lse, rtol)
    # and the plain-ops reference the Metal self-check uses agrees
    if t is None:
        plain = host.plain_decode(q, cache._key_side, cache._value_side, arrays, scale, cache._shifts, sinks)
        _close(*plain, ref_out, ref_lse, 1e-5)


@needs_cxx
def test_sinks_none_runs_the_kernels_it_always_ran_and_minus_infinity_is_no_sink():
    cache = build_cache("turbo4", 2, 64, mx.float32, 256, seed=1, tail=30)
    assert tail(cache) is not None
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(2))
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
    args = (call, q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts)
    runs = {}
    for label, sinks in (("none", None), ("-inf", mx.full((4,), -math.inf))):
        launched = []

        def factory(v):
            launched.append(v)
            return emulate.kernel(v)

        runs[label] = (host.launch(factory, *args, tail=tail(cache), sinks=sinks), launched)
    (out, lse), plain = runs["none"]
    assert not any(getattr(v, "sinks", False) for v in plain)
    assert [v.name for v in plain] == [call.pass1.name, host.tail_pass2(call, q, tail(cache)).name]
    ref_out, ref_lse = reference(cache, q, 0.125)
    _close(out, lse, ref_out, ref_lse, 1e-5)
    (out2, lse2), sunk = runs["-inf"]
    assert sunk[-1].sinks and sunk[0] == plain[0]  # the same pass 1
    assert mx.array_equal(out2, out).item() and mx.array_equal(lse2, lse).item()


@needs_cxx
def test_fused_decode_takes_sinks_of_one_per_query_head(monkeypatch):
    """The entry point on CUDA (emulated): sinks [Hq] in any float dtype; another shape is no
    kernel's (None: the caller's plain-ops path decides)."""
    cache = build_cache("turbo8v3", 2, 64, mx.float16, 256, seed=2, tail=9)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(3)).astype(mx.float16)
    sinks = _sinks(cache, q, 0.125, (0.5, -1.0, 1.5), mx.bfloat16)
    force_backend(monkeypatch, "cuda", emulate.kernel)
    args = (q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts, tail(cache))
    out, lse = kernels.fused_decode(*args, sinks=sinks)
    ref_out, ref_lse = reference(cache, q, 0.125, sinks=sinks)
    assert out.dtype == mx.float16
    _close(out, lse, ref_out, ref_lse, 2e-3)
    for bad in (sinks[:4], sinks.reshape(2, 3), mx.zeros((1, 6, 1))):
        assert kernels.fused_decode(*args, sinks=bad) is None


@needs_cxx
def test_metal_self_check_covers_sinks(monkeypatch):
    """Metal (emulated): a shape with sinks is checked on its own against the plain-ops path with
    sinks; a kernel that leaves the sink out of the normaliser is caught and dropped."""
    metal.reset()
    cache = build_cache("turbo4", 2, 64, mx.float16, 256, seed=7, tail=20)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(7)).astype(mx.float16)
    sinks = _sinks(cache, q, 0.125, (1.0, -0.5))
    args = (q, cache._key_side, cache._value_side, stored(cache), 0.125, cache._shifts, tail(cache))
    refs = []
    real_plain = host.plain_decode

    def counting_plain(*a):
        refs.append(a[-1] is not None)
        return real_plain(*a)

    monkeypatch.setattr(host, "plain_decode", counting_plain)
    force_backend(monkeypatch, "metal", emulate.kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.fused_decode(*args) is not None
        out, lse = kernels.fused_decode(*args, sinks=sinks)
        kernels.fused_decode(*args, sinks=sinks)
    assert refs == [False, True]  # one check per shape, the sink shape with sinks
    ref_out, ref_lse = reference(cache, q, 0.125, sinks=sinks)
    _close(out, lse, ref_out, ref_lse, 2e-3)

    metal.reset()
    refs.clear()
    dropped = []

    def broken(v):
        if isinstance(v, Pass2) and v.sinks:
            dropped.append(v)
            plain = emulate.kernel(Pass2(v.d, v.rotate, v.tail_dtype, v.q_dtype, v.out_dtype))
            return lambda *, inputs, **kw: plain(inputs=inputs[:-1], **kw)
        return emulate.kernel(v)

    force_backend(monkeypatch, "metal", broken)
    with pytest.warns(RuntimeWarning, match="with sinks disagrees with the plain-ops path"):
        assert kernels.fused_decode(*args, sinks=sinks) is None
    assert dropped and refs == [True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.fused_decode(*args) is not None  # the shape without sinks still passes its own check
    metal.reset()


nvcc = shutil.which("nvcc")


# nvcc on 2 cores (30 s and 6 s): on demand and on the GPU machine; the default run pins the
# generated text byte for byte instead (tests/test_kernel_digests.py).
@pytest.mark.slow
@pytest.mark.skipif(nvcc is None, reason="needs nvcc")
def test_sink_sources_compile(tmp_path):
    picks = [Pass2(d=d, rotate=rot, tail_dtype=dt, q_dtype=dt, out_dtype=od, sinks=True)
             for d, rot in ((128, True), (80, False)) for dt, od in (("", ""), ("float16", "float16"),
                                                                     ("bfloat16", "bfloat16"), ("float32", ""))]
    src = tmp_path / "sinks.cu"
    src.write_text("\n".join(translation_unit(v) for v in picks))
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
