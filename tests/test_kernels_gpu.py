"""The fused decode kernels on a real GPU (CUDA or Metal) against a float64 reference.

Marked `gpu`: skipped without a GPU backend. On the device machine, with only the GPU recipe's
packages (the conftest imports test-only packages inside its fixtures):
`python3 -m pytest -m gpu tests/test_kernels_gpu.py`.

Coverage is a covering design rather than the full product (every compile costs device time):
every layout meets every head dim, every GQA ratio of {1, 2, 4, 7}, every bit width and every
activation dtype; each case checks T in {1, 63, 64, 65, 4096} from one cache (token views of it,
which are strided like the cache's own), NaN-poisoned outputs fully overwritten and bit-identical
repeats; a few representative cases run at T = 70000, the full attention path (kernels plus
the raw tail, which pass 2 takes on CUDA) runs once per layout, and the benchmark shape runs
under every lane shape the benchmark sweeps. The tensor-core pass 1 (CUDA) has its own covering
cases, held to RTOL_MMA. Attention sinks run through the entry point with both pass 1 kinds and
the raw tail. About 5 minutes on an H200, most of it NVRTC compiles.
"""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels import KernelTuning, host
from turboquant.attention.kernels.mma import MmaPass1
from turboquant.cache.mirror import MIRROR_ENV
from turboquant.cache.compressed import TurboQuantKVCache
from kernel_support.synthetic import attention64, build_cache, dequantized, stored, tail

from kernel_support.reference import causal64, from_scratch, reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernels_at_every_length(monkeypatch):
    """Short contexts reach the kernels: no decoded mirror stands in (turboquant/cache/mirror.py)."""
    monkeypatch.setenv(MIRROR_ENV, "0")

LAYOUTS = {
    "rawk-turbo": ["turbo0v2", "turbo0v3", "turbo0v4"],
    "affinek-turbo": ["turbo8v2", "turbo8v3", "turbo8v4"],
    "calibrated": ["turbo2", "turbo3", "turbo4", "turbo4v2"],
    "turbo": ["turbo2", "turbo3", "turbo4"],
    "affine": ["affine8", "affine4"],
}
D_VALUES = (64, 80, 96, 128, 256)
R_VALUES = (1, 2, 4, 7)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
T_VIEWS = (1, 63, 64, 65, 4096)
H = 2
RTOL = 1e-4  # float32 kernel vs float64 reference, relative to max |reference|
RTOL_MMA = 2e-3  # tensor-core pass 1: fp16 products (each factor rounded at most 2^-11), float32 sums


def covering_cases():
    cases = []
    for li, (layout, schemes) in enumerate(LAYOUTS.items()):
        i = li
        for d in D_VALUES:
            if d == 80 and layout in ("affinek-turbo", "affine"):
                continue  # no MLX affine group size divides 80: such layers stay native
            for _ in range(1 if layout == "turbo" else 2):
                cases.append((layout, schemes[i % len(schemes)], d, R_VALUES[i % 4], DTYPES[i % 3]))
                i += 1
    return cases


CASES = covering_cases()


def _id(c):
    return f"{c[0]}-{c[1]}-d{c[2]}-R{c[3]}-{str(c[4]).split('.')[-1]}"


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    mx.set_memory_limit(40 << 30)
    yield
    mx.set_default_device(previous)


def _backend_kernel():
    backend = kernels.select_backend()
    assert backend in ("cuda", "metal")
    if backend == "cuda":
        from turboquant.attention.kernels import cuda

        return cuda.kernel
    from turboquant.attention.kernels import metal

    return metal.kernel


def _check(out, lse, ref_out, ref_lse, what, rtol=RTOL):
    out = np.array(out).astype(np.float64)
    lse = np.array(lse).astype(np.float64)
    assert np.isfinite(out).all() and np.isfinite(lse).all(), what
    scale = np.abs(ref_out).max()
    err = np.abs(out - ref_out).max() / scale
    lerr = np.abs(lse - ref_lse).max() / max(1.0, np.abs(ref_lse).max())
    assert err <= rtol and lerr <= rtol, (what, err, lerr)
    return err, lerr


def _run_views(cache, q, scale, t_values, k64, v64, tensor_cores=False, tuning=None):
    """Kernel over the first T stored rows for each T: matches f64, fully written, repeatable.
    `tensor_cores`: the tensor-core pass 1 (CUDA; fp16 products, so RTOL_MMA). `tuning`: a
    KernelTuning (None: the environment's)."""
    make = _backend_kernel()
    ks, vs = cache._key_side, cache._value_side
    full = stored(cache)
    worst = 0.0
    for T in t_values:
        arrays = {n: a[:, :, :T] for n, a in full.items()}
        shifts = None if cache._shifts is None else cache._shifts[:, : -(-T // 256)]
        assert kernels.fused_decode(q, ks, vs, arrays, scale, shifts, tuning=tuning) is not None
        call = host.describe(q, ks, vs, arrays, shifts, tensor_cores=tensor_cores, tuning=tuning)
        assert isinstance(call.pass1, MmaPass1) == tensor_cores
        args = (call, q, ks, vs, arrays, scale, shifts)
        out, lse, po, pm, pl = host.launch(make, *args, init_value=float("nan"), partials=True, tuning=tuning)
        for part in (po, pm, pl):
            assert not mx.any(mx.isnan(part)).item(), (call.pass1.name, T)
        ref_out, ref_lse = attention64(q, k64[:, :, :T], v64[:, :, :T], scale)
        err, _ = _check(out, lse, ref_out, ref_lse, (call.pass1.name, T), RTOL_MMA if tensor_cores else RTOL)
        worst = max(worst, err)
        again = host.launch(make, *args, tuning=tuning)
        assert mx.array_equal(again[0], out).item() and mx.array_equal(again[1], lse).item(), (call.pass1.name, T)
    return worst


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_f64_reference(case):
    layout, scheme, d, R, dtype = case
    cache = build_cache(scheme, H, d, dtype, max(T_VIEWS), seed=d * 7 + R, calibrated=layout != "turbo")
    assert cache is not None and cache.layout.value == layout
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(d + R)).astype(dtype)
    k64, v64 = dequantized(cache)
    _run_views(cache, q, 1 / math.sqrt(d), T_VIEWS, k64, v64)


LONG = [("affinek-turbo", "turbo8v3", 128, 4, mx.float16), ("rawk-turbo", "turbo0v4", 128, 7, mx.bfloat16),
        ("calibrated", "turbo4", 64, 2, mx.float32), ("affine", "affine8", 96, 1, mx.float16)]


@pytest.mark.parametrize("case", LONG, ids=_id)
def test_kernel_long_context(case):
    layout, scheme, d, R, dtype = case
    cache = build_cache(scheme, H, d, dtype, 70000, seed=11)
    assert cache.layout.value == layout
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(3)).astype(dtype)
    k64, v64 = dequantized(cache)
    _run_views(cache, q, 1 / math.sqrt(d), (70000,), k64, v64)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_attention_with_tail_in_activation_dtype(layout):
    """The whole decode step: kernel over stored rows, raw tail merged with plain ops."""
    scheme = LAYOUTS[layout][-1]
    dtype = mx.bfloat16 if layout in ("rawk-turbo", "affine") else mx.float16
    cache = build_cache(scheme, H, 128, dtype, 512, seed=5, tail=77, calibrated=layout != "turbo")
    assert cache.offset == 589 and cache.stored == 512
    q = mx.random.normal((1, H * 4, 1, 128), key=mx.random.key(8)).astype(dtype)
    out = cache.attention(q, 1 / math.sqrt(128), None)
    assert out.dtype == dtype
    ref, _ = reference(cache, q, 1 / math.sqrt(128))
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - ref)
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype] * np.abs(ref)
    # fp16/bf16 activations and outputs: within 2e-3 of the largest output
    assert np.all(err <= 2 * ulp + 2e-3 * np.abs(ref).max())


def test_bfloat16_key_of_70000_stays_finite():
    cache = build_cache("turbo0v4", H, 128, mx.bfloat16, 300, seed=2)
    keys = stored(cache)["keys"]
    keys[:, :, 10, 7] = 70000.0
    q = mx.random.normal((1, H * 2, 1, 128), key=mx.random.key(0)).astype(mx.bfloat16) * 30
    res = kernels.fused_decode(q, cache._key_side, cache._value_side, {**stored(cache), "keys": keys}, 1 / 128**0.5)
    assert res is not None
    assert mx.all(mx.isfinite(res[0])).item() and mx.all(mx.isfinite(res[1])).item()


@pytest.mark.parametrize("lanes", [(1, 2), (1, 4), (2, 2), (1, 8)], ids=lambda x: f"ns{x[0]}u{x[1]}")
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3", "turbo0v4"])
def test_benchmark_shape_every_lane_shape(scheme, lanes):
    """The lane shapes and unrolls the benchmark sweeps (32 query / 8 KV heads, d=128), one
    block (a long loop) and many blocks."""
    cache = build_cache(scheme, 8, 128, mx.float16, 3000, seed=4)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(6)).astype(mx.float16)
    k64, v64 = dequantized(cache)
    for tgs in (1, 1024):
        tuning = KernelTuning(ns=lanes[0], unroll=lanes[1], threadgroups=tgs)
        _run_views(cache, q, 1 / math.sqrt(128), (3000,), k64, v64, tuning=tuning)


# The tensor-core pass 1 (CUDA only): every layout it serves meets every head dim, GQA 1/2/4/7 and
# 9 (two row groups), both half dtypes and both prefetch modes.
MMA_CASES = [
    ("affinek-turbo", "turbo8v3", 128, 4, mx.float16, None), ("affinek-turbo", "turbo8v2", 64, 9, mx.bfloat16, True),
    ("affinek-turbo", "turbo8v4", 96, 7, mx.float16, False), ("affinek-turbo", "turbo8v3", 256, 1, mx.bfloat16, None),
    ("calibrated", "turbo4", 128, 4, mx.float16, None), ("calibrated", "turbo3", 80, 2, mx.bfloat16, None),
    ("calibrated", "turbo2", 256, 7, mx.float16, True), ("calibrated", "turbo4v2", 64, 1, mx.bfloat16, False),
    ("turbo", "turbo3", 96, 9, mx.float16, None), ("turbo", "turbo4", 64, 2, mx.bfloat16, False),
]


# The tensor-core pass 1 from the first stored row (the default; spelled out for the cases).
ANY_LENGTH = KernelTuning(mma_min_tokens=0)


def _cuda_only():
    if kernels.select_backend() != "cuda":
        pytest.skip("the tensor-core pass 1 is CUDA only")


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: _id(c[:5]) + f"-p{c[5]}")
def test_tensor_core_kernel_matches_f64_reference(case):
    _cuda_only()
    layout, scheme, d, R, dtype, prefetch = case
    cache = build_cache(scheme, H, d, dtype, max(T_VIEWS), seed=d * 5 + R, calibrated=layout != "turbo")
    assert cache.layout.value == layout
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(d + 2 * R)).astype(dtype)
    k64, v64 = dequantized(cache)
    _run_views(cache, q, 1 / math.sqrt(d), T_VIEWS, k64, v64, tensor_cores=True,
               tuning=dataclasses.replace(ANY_LENGTH, mma_prefetch=prefetch))


# The newer schemes' layer layouts (issue 31): 5-bit TurboQuant keys, float16 row norms, and the
# key layouts an autoB allocation leaves a layer with; both pass 1 kinds where they apply.
NEW_LAYOUT_CASES = [
    ("turbo5v4", "base", 128, 4, mx.float16), ("turbo5v4", "base", 64, 7, mx.bfloat16),
    ("turbo5v3", "base", 96, 2, mx.float32), ("turbo5v2", "base", 256, 1, mx.float16),
    ("auto3.5", "base", 128, 1, mx.bfloat16), ("auto3.75", "keys4", 80, 4, mx.float16),
    ("auto3.75", "keys5", 128, 9, mx.bfloat16), ("auto6", "keys8", 128, 4, mx.bfloat16),
    ("turbo5v4", "protected", 64, 2, mx.float16),
]


@pytest.mark.parametrize("case", NEW_LAYOUT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-R{c[3]}-{str(c[4]).split('.')[-1]}")
def test_new_scheme_layouts_match_f64_reference(case):
    scheme, keys, d, R, dtype = case
    cache = build_cache(scheme, H, d, dtype, max(T_VIEWS), seed=d * 3 + R, keys=keys)
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(d + 3 * R)).astype(dtype)
    k64, v64 = dequantized(cache)
    _run_views(cache, q, 1 / math.sqrt(d), T_VIEWS, k64, v64, tuning=dataclasses.replace(ANY_LENGTH, mma=False))
    half = dtype in (mx.float16, mx.bfloat16) and cache._value_side.format.value == "turbo" and d % 16 == 0
    if half and kernels.select_backend() == "cuda":
        _run_views(cache, q, 1 / math.sqrt(d), T_VIEWS, k64, v64, tensor_cores=True, tuning=ANY_LENGTH)


@pytest.mark.parametrize("case", [("affinek-turbo", "turbo8v3", 128, 4, mx.float16),
                                  ("calibrated", "turbo4", 64, 7, mx.bfloat16)], ids=_id)
def test_tensor_core_kernel_long_context(case):
    _cuda_only()
    layout, scheme, d, R, dtype = case
    cache = build_cache(scheme, H, d, dtype, 70000, seed=13)
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(5)).astype(dtype)
    k64, v64 = dequantized(cache)
    _run_views(cache, q, 1 / math.sqrt(d), (70000,), k64, v64, tensor_cores=True, tuning=ANY_LENGTH)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
def test_tensor_core_benchmark_shape(scheme, prefetch):
    """32 query / 8 KV heads, d=128: one block per head (a long loop) and many blocks."""
    _cuda_only()
    cache = build_cache(scheme, 8, 128, mx.float16, 3000, seed=4)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(6)).astype(mx.float16)
    k64, v64 = dequantized(cache)
    for tgs in (1, 1024):
        tuning = dataclasses.replace(ANY_LENGTH, mma_prefetch=prefetch, threadgroups=tgs)
        _run_views(cache, q, 1 / math.sqrt(128), (3000,), k64, v64, tensor_cores=True, tuning=tuning)


# Attention sinks (gpt-oss: 64 query / 8 KV heads, d = 64): the whole entry point with the raw tail
# in pass 2, CUDA-core and tensor-core pass 1 (RTOL_MMA), float32 held to RTOL. Sinks sit at each
# head's own log-sum-exp plus an offset, so each takes a visible share of the normaliser; +1000
# takes all of it (no overflow), -1000 none.
SINK_CASES = [
    ("turbo4", 64, 8, mx.bfloat16, 4096, 77, False), ("turbo4", 64, 8, mx.float32, 4096, 30, False),
    ("turbo8v3", 64, 8, mx.bfloat16, 4096, 200, True), ("affine8", 128, 4, mx.float16, 4096, 0, False),
    ("turbo3", 128, 4, mx.float16, 70000, 0, True),
]
SINK_OFFSETS = (-3.0, 0.0, 2.0, 1000.0, -1000.0)


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-R{c[2]}-{str(c[3]).split('.')[-1]}"
                                                          f"-T{c[4]}+{c[5]}-mma{int(c[6])}")
def test_decode_with_sinks_matches_f64_softmax_with_the_sink(case):
    scheme, d, R, dtype, T, n, mma = case
    tuning = KernelTuning(mma=False)
    if mma:
        _cuda_only()
        tuning = ANY_LENGTH
    cache = build_cache(scheme, H, d, dtype, T, seed=d + n, tail=n)
    q = mx.random.normal((1, H * R, 1, d), key=mx.random.key(R + n)).astype(dtype)
    scale = 1 / math.sqrt(d)
    _, lse0 = reference(cache, q, scale)
    sinks = mx.array([lse0.reshape(-1)[i] + SINK_OFFSETS[i % len(SINK_OFFSETS)] for i in range(H * R)])
    sinks = sinks.astype(mx.bfloat16 if dtype == mx.bfloat16 else mx.float32)
    t = tail(cache)
    assert (t is not None) == (n > 0)
    args = (q, cache._key_side, cache._value_side, stored(cache), scale, cache._shifts, t)
    call = host.describe(*args[:4], cache._shifts, tensor_cores=kernels.select_backend() == "cuda", tuning=tuning)
    assert isinstance(call.pass1, MmaPass1) == mma
    out, lse = kernels.fused_decode(*args, sinks=sinks, tuning=tuning)
    ref_out, ref_lse = reference(cache, q, scale, sinks=sinks)
    assert out.dtype == dtype
    rtol = RTOL if dtype == mx.float32 else RTOL_MMA
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    # the output is rounded to the activation dtype once (half an ulp; 2 allowed)
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 0.0}[dtype]
    assert np.all(np.abs(got - ref_out) <= 2 * ulp * np.abs(ref_out) + rtol * np.abs(ref_out).max()), case
    # each head's lse against its own size (the +1000 sinks' would hide the others')
    assert np.all(np.abs(np.array(lse) - ref_lse) <= rtol * np.maximum(1.0, np.abs(ref_lse))), case
    heads = got.reshape(H * R, d)
    assert np.abs(heads[3::len(SINK_OFFSETS)]).max() <= 1e-30
    # sinks of -inf are no sinks: the same bits as sinks=None
    plain = kernels.fused_decode(*args, tuning=tuning)
    none = kernels.fused_decode(*args, sinks=mx.full((H * R,), -math.inf), tuning=tuning)
    assert mx.array_equal(plain[0], none[0]).item() and mx.array_equal(plain[1], none[1]).item()


# One decode step in a fresh process (bf16 turbo4 with a raw tail: pass 1 and pass 2), its output
# saved to argv[1].
DECODE_STEP = """
import sys
import mlx.core as mx
import numpy as np
from kernel_support.synthetic import build_cache
mx.set_default_device(mx.gpu)
cache = build_cache("turbo4", 8, 128, mx.bfloat16, 4096, seed=3, tail=40)
q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(2)).astype(mx.bfloat16)
out = cache.attention(q, 0.088)
np.save(sys.argv[1], np.array(out.astype(mx.float32)))
"""


def _decode_process(out: Path, folder: Path, **env) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    # the repository (turboquant) and tests/ (kernel_support: the synthetic caches)
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder), PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]),
               **env)
    return subprocess.run([sys.executable, "-c", DECODE_STEP, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_compiled_modules_serve_the_next_process(tmp_path):
    """The first launch writes each module to MLX's cache folder; MLX loads that very file (a
    damaged copy makes the launch fail), and the modules compute the bits MLX's own compile does."""
    _cuda_only()
    folder = tmp_path / "ptx"
    first = _decode_process(tmp_path / "first.npy", folder)
    assert first.returncode == 0, first.stderr[-3000:]
    modules = sorted(folder.glob("custom_kernel_*.ptx"))
    assert len(modules) >= 2 and all(m.with_suffix(".txt").exists() for m in modules), modules
    second = _decode_process(tmp_path / "second.npy", folder)
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(folder.glob("custom_kernel_*.ptx")) == modules
    own = _decode_process(tmp_path / "own.npy", tmp_path / "empty", TQSTORE_KERNEL_CACHE="0")
    assert own.returncode == 0, own.stderr[-3000:]
    assert not list((tmp_path / "empty").glob("custom_kernel_*"))
    results = [np.load(tmp_path / f"{n}.npy") for n in ("first", "second", "own")]
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])
    for m in modules:
        m.write_bytes(b"not a module")
    damaged = _decode_process(tmp_path / "damaged.npy", folder)
    assert damaged.returncode != 0 and "Failed to load compiled" in damaged.stderr, damaged.stderr[-3000:]


@pytest.mark.parametrize("scheme,dtype", [("turbo4", mx.bfloat16), ("turbo8v3", mx.float16), ("affine8", mx.bfloat16),
                                          ("turbo4", mx.float32), ("turbo5v4", mx.bfloat16), ("auto3.75", mx.float16)],
                         ids=str)
def test_question_prefill_matches_f64(scheme, dtype):
    """A 16-token question after 4096 stored rows (the decode kernels with the tokens as query
    rows, the tail causal in pass 2) against float64, and the same through the rows decoded
    into SDPA (TQSTORE_KERNEL_PREFILL=0)."""
    cache = build_cache(scheme, 8, 128, dtype, 4096, seed=21, tail=40)
    q = mx.random.normal((1, 32, 16, 128), key=mx.random.key(9)).astype(dtype)
    k64, v64 = dequantized(cache)
    ref = causal64(q, k64, v64, 1 / math.sqrt(128))
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 0.0}[dtype]
    # (float32 activations: the kernels are all float32, but the raw tail joins through float32
    # matmuls, which run as TF32 on CUDA, as do the decoded rows' SDPA products: measured 2.4e-4)
    rtol = RTOL_MMA
    for fused in ("1", "0"):
        os.environ["TQSTORE_KERNEL_PREFILL"] = fused
        try:
            out = cache.attention(q, 1 / math.sqrt(128), "causal")
        finally:
            os.environ.pop("TQSTORE_KERNEL_PREFILL")
        got = np.array(out.astype(mx.float32)).astype(np.float64)
        assert np.all(np.abs(got - ref) <= 2 * ulp * np.abs(ref) + rtol * np.abs(ref).max()), (fused, scheme)



@pytest.mark.parametrize("stored_rows,tail_rows", [(4000, 40), (4096, 240)], ids=["open-block", "tail-256"])
def test_question_over_a_long_tail_matches_f64(stored_rows, tail_rows):
    """A 16-token question whose tail pass 2 attends over causally per query row: after a store
    whose last block is open (the decode rows wait raw in the tail) and with the tail at pass 2's
    limit of 256 rows."""
    cache = build_cache("turbo4", 8, 128, mx.bfloat16, stored_rows, seed=23, tail=tail_rows)
    assert cache.stored == stored_rows
    k, v = (mx.random.normal((1, 8, 16, 128), key=mx.random.key(s)).astype(mx.bfloat16) for s in (3, 4))
    cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 32, 16, 128), key=mx.random.key(10)).astype(mx.bfloat16)
    k64, v64 = dequantized(cache)
    ref = causal64(q, k64, v64, 1 / math.sqrt(128))
    got = np.array(cache.attention(q, 1 / math.sqrt(128), "causal").astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(got - ref) <= 2 * 2.0**-7 * np.abs(ref) + RTOL_MMA * np.abs(ref).max())


def _from_scratch(q, cache, scale, causal=0):
    from turboquant.attention.kernels import cuda

    return from_scratch(cuda.kernel, q, cache, scale, causal)[0]


def test_replayed_decode_steps_equal_fresh_ones():
    """The cache's kept decode step (kernels/steps.py) replays the same kernels on the GPU: every
    step equals the one built from scratch, across the block that fills at 4352 rows."""
    cache = build_cache("turbo4", 8, 128, mx.bfloat16, 4096, seed=31, tail=250)
    k, v = (mx.random.normal((1, 8, 10, 128), key=mx.random.key(s)).astype(mx.bfloat16) for s in (5, 6))
    for t in range(10):
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(40 + t)).astype(mx.bfloat16)
        assert mx.array_equal(cache.attention(q, 0.088), _from_scratch(q, cache, 0.088)).item(), t
    assert cache.stored == 4352


def test_questions_after_restores_equal_ones_built_from_scratch():
    """A question after a restore and its first decode step come from the process's templates
    (kernels/steps.py) with the restore's own buffers filled in: on the GPU, each equals the
    call built from scratch, restore after restore."""
    cache = build_cache("turbo4", 8, 128, mx.bfloat16, 4096, seed=33, tail=20)
    record, codecs = cache.to_record(), cache.plan.codecs()
    for restore in range(3):
        restored = TurboQuantKVCache.from_record(record, codecs)
        k = mx.random.normal((1, 8, 17, 128), key=mx.random.key(restore)).astype(mx.bfloat16)
        restored.update_and_fetch(k[:, :, :16], k[:, :, :16])
        q = mx.random.normal((1, 32, 16, 128), key=mx.random.key(50 + restore)).astype(mx.bfloat16)
        got = restored.attention(q, 0.088, "causal")
        assert mx.array_equal(got, _from_scratch(q, restored, 0.088, causal=16)).item(), restore
        restored.update_and_fetch(k[:, :, 16:], k[:, :, 16:])
        q1 = mx.random.normal((1, 32, 1, 128), key=mx.random.key(70 + restore)).astype(mx.bfloat16)
        assert mx.array_equal(restored.attention(q1, 0.088), _from_scratch(q1, restored, 0.088)).item(), restore
