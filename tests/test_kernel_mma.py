"""The tensor-core pass 1 (`turboquant/attention/kernels/mma.py`) without a GPU: which decode steps it
serves, its CUDA source for every structure, and the kernel itself run on the CPU through the
emulator (whose `mma.sync` follows the PTX fragment layouts) against a float64 reference.

Its products take fp16 inputs (the query, the dequantized K and V elements, the probabilities
times value norms: each rounded with relative error at most 2^-11) and float32 sums; the outputs
are compared at 2e-3 of the largest reference output, the accuracy of fp16 activations (the
CUDA-core kernel, all float32, is held to 1e-5 in test_kernel_sources.py)."""

import dataclasses
import functools
import itertools
import math
import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention.kernels import DEFAULT_TUNING, KernelTuning, host
from turboquant.attention.kernels import dialects
from turboquant.attention.kernels import template as tpl
from turboquant.attention.kernels.cuda import translation_unit
from turboquant.attention.kernels.mma import MAX_TILED_D, MMA_KEY_BITS, MMA_ROWS, MMA_VALUE_BITS, MmaPass1, table_copies
from kernel_support.synthetic import build_cache, stored

from kernel_support import emulate, on_demand
from kernel_support.reference import reference

RTOL = 2e-3


# The tensor-core pass 1 from the first stored row (by default only long caches use it).
ANY_LENGTH = KernelTuning(mma_min_tokens=0)


needs_cxx = pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")


def mma_variants():
    keys = [("turbo", b, 0, "") for b in MMA_KEY_BITS]
    keys += [("affine", b, g, dt) for b, g, dt in itertools.product(tpl.AFFINE_BITS, tpl.AFFINE_GROUPS,
                                                                    tpl.NATIVE_DTYPES)]
    out = []
    for d in (64, 80, 96, 128, 256):
        for (kf, kb, kg, kd), vb, shifts, prefetch in itertools.product(keys, MMA_VALUE_BITS, (False, True),
                                                                        (0, 1, 2)):
            if kf == "affine" and d % kg:
                continue
            raw = kf == "affine" or not d & (d - 1)  # turbo keys: a Hadamard butterfly in pass 1
            for q_dtype in ("",) + (("float16", "bfloat16") if raw and prefetch == 1 else ()):
                out.append(MmaPass1(d=d, key=kf, key_bits=kb, key_group=kg, key_dtype=kd, value="turbo",
                                    value_bits=vb, value_group=0, value_dtype="", rmax=MMA_ROWS, shifts=shifts,
                                    prefetch=prefetch, q_dtype=q_dtype))
    return out


VARIANTS = mma_variants()
UNSPREAD = [dataclasses.replace(v, spread=False) for v in VARIANTS if v.d == 128 and v.prefetch == 1]
# two row tiles (a question's rows): head dims up to MAX_TILED_D
TILED = [dataclasses.replace(v, rmax=2 * MMA_ROWS) for v in VARIANTS if v.d <= MAX_TILED_D]


@pytest.fixture(scope="module")
def cuda_source():
    """`tpl.source(v, "cuda")` made once per variant for the module: the two whole-grid tests read
    the same 5000 texts (a variant is a frozen dataclass, its text a function of its fields), and
    the texts (over 100 MB) go with the module."""
    return functools.cache(lambda v: tpl.source(v, "cuda"))


def threadgroup_bytes(v, text: str) -> int:
    """Static threadgroup memory that `text`, the body of `v`, declares."""
    consts = {"RMAX": v.rmax, "D": v.d, "NW": tpl.THREADS // 32, "MAXSB": tpl.MAX_SHIFT_BLOCKS}
    size = {"float": 4, "uint32_t": 4, "F4": 16}
    return sum(size[t] * eval(n, {}, consts) for t, n in re.findall(r"TGMEM (\w+) \w+\[([^\]]+)\];", text))


def test_spread_tables_fit_static_threadgroup_memory(cuda_source):
    """CUDA lets a kernel declare 48 KB of static threadgroup memory; the spread pair tables take
    the room that is left (16 KB each at d <= 128), never more."""
    def declared(v):
        return threadgroup_bytes(v, cuda_source(v)[1])

    worst = {}
    for v in VARIANTS + TILED:
        worst[v.d] = max(worst.get(v.d, 0), declared(v))
    assert max(worst.values()) <= 48 * 1024, worst
    assert worst[128] > 40 * 1024  # turbo4 at d=128 uses most of it (two 16 KB tables)
    plain = dataclasses.replace(VARIANTS[0], spread=False)
    assert declared(plain) < declared(VARIANTS[0])


def c_int(expr: str, **names) -> int:
    """A C integer expression of the kernel text evaluated in Python (non-negative operands, so
    C's `/` is Python's `//`)."""
    return eval(expr.replace(" / ", " // "), {}, names)


@pytest.mark.parametrize("d,tiles", [(64, 1), (80, 1), (96, 1), (128, 1), (256, 1), (64, 2), (128, 2)])
def test_warp_merge_is_one_bank_wavefront_per_access_and_writes_out_every_element(d, tiles):
    """The four warps' outputs meet in threadgroup memory in the fragment layout: every store or
    load of a warp touches 32 different banks (the row-major layout took sixteen wavefronts per
    access), the layout is a bijection onto the buffer (each row tile its own 8 * d words), and
    the write-out reads element (row, dim) from where the lane holding it stored it."""
    v = dataclasses.replace(VARIANTS[0], d=d, rmax=MMA_ROWS * tiles)
    text = tpl.source(v, "cuda")[1]
    store, load = re.findall(r"const int at = (.*);", text)
    jk_expr, = re.findall(r"const int jk = (.*);", text)
    run_expr, = re.findall(r"const int run = (.*);", text)
    cv = d // 8
    words = set()
    for q, j, k in itertools.product(range(tiles), range(d // 16), range(4)):
        at = [c_int(store, q=q, j=j, k=k, lane=lane, D=d) for lane in range(32)]
        assert len({a % 32 for a in at}) == 32, (j, k)
        words.update(at)
    assert words == set(range(v.rmax * d))
    for r, dim in itertools.product(range(v.rmax), range(d)):
        run = c_int(run_expr, d=dim, CV=cv)
        jk = c_int(jk_expr, d=dim, run=run, CV=cv, r=r)
        # the lane (g, c) holding (row 8q + 2c + i, dim g * CV + 2j + e) keeps it as element 2e + i of
        # m-tile j of tile q
        j, e, i, g, c = (dim % cv) >> 1, dim & 1, r & 1, dim // cv, (r & 7) >> 1
        assert c_int(load, jk=jk, run=run, r=r, D=d) == c_int(store, q=r >> 3, j=j, k=2 * e + i, lane=4 * g + c, D=d)


@pytest.mark.parametrize("bits,spread", list(itertools.product(MMA_VALUE_BITS, (True, False))))
def test_pair_table_fill_stores_every_copy_of_every_entry_once(bits, spread):
    """Each thread stores the copies of the entries whose codes it loaded at the kernel's start:
    every word of a table is stored exactly once, with the pair of its own entry."""
    v = dataclasses.replace(VARIANTS[0], d=128, key_bits=bits, value_bits=bits, spread=spread)
    text = tpl.source(v, "cuda")[1]
    mask, = {int(x) for x in re.findall(r"const int e = \(tid \+ u \* NT\) & (\d+);", text)}
    (guard, index, per), _ = re.findall(r"(if \(i < \d+\) )?s_[kv]pair\[(.*)\] = [kv]pv\[m % (\d+)\];", text)
    n, copies = 1 << (2 * bits), table_copies(bits, 128, spread)
    total, per = n * copies, int(per)
    assert mask == n - 1 and per == max(1, n // tpl.THREADS)
    stored = []
    for tid, m in itertools.product(range(tpl.THREADS), range(-(-total // tpl.THREADS))):
        i = tid + m * tpl.THREADS
        if guard and i >= total:
            continue
        word = c_int(index, i=i)
        assert word // copies == (tid + (m % per) * tpl.THREADS) & mask  # the entry of the pair it stores
        stored.append(word)
    assert sorted(stored) == list(range(total))


def test_every_variant_generates_cuda_and_refuses_metal(cuda_source):
    names = set()
    for v in VARIANTS + UNSPREAD + TILED:
        assert v.name not in names
        names.add(v.name)
        header, body = cuda_source(v)
        text = header + body
        assert not dialects.leftover_markers(text), (v.name, dialects.leftover_markers(text)[:3])
        assert text.count("{") == text.count("}") and text.count("(") == text.count(")"), v.name
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in header
        assert v.input_names() == tpl.Pass1.input_names(v)  # same inputs as the CUDA-core pass 1
        with pytest.raises(ValueError):
            tpl.source(v, "metal")
    assert len(names) > 1000


def test_structures_without_a_tensor_core_kernel_are_refused():
    base = dict(d=128, key="turbo", key_bits=4, key_group=0, key_dtype="", value="turbo", value_bits=4,
                value_group=0, value_dtype="", rmax=MMA_ROWS, shifts=False)
    MmaPass1(**base)
    for change in ({"d": 72}, {"key": "native", "key_bits": 0, "key_dtype": "float16"}, {"rmax": 4},
                   {"value": "affine", "value_bits": 8, "value_group": 64, "value_dtype": "float16"}):
        with pytest.raises(ValueError):
            MmaPass1(**{**base, **change})


@pytest.mark.parametrize("scheme,dtype,expected", [
    ("turbo4", mx.float16, MmaPass1), ("turbo8v3", mx.bfloat16, MmaPass1), ("turbo4", mx.float32, tpl.Pass1),
    ("turbo0v4", mx.float16, tpl.Pass1), ("affine8", mx.float16, tpl.Pass1)])
def test_describe_uses_tensor_cores_for_half_activations(scheme, dtype, expected):
    cache = build_cache(scheme, 2, 64, dtype, 300)
    q = mx.zeros((1, 4, 1, 64), dtype=dtype)
    args = (q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
    assert type(host.describe(*args, tensor_cores=True, tuning=ANY_LENGTH).pass1) is expected
    assert type(host.describe(*args, tuning=ANY_LENGTH).pass1) is tpl.Pass1


def test_the_tensor_core_kernel_serves_every_length():
    """No length threshold: a second pass-1 module past one cost a build at the first long
    question (test_kernel_builds.py counts the builds)."""
    q = mx.zeros((1, 4, 1, 64), dtype=mx.float16)
    cache = build_cache("turbo4", 2, 64, mx.float16, 300, calibrated=False)
    full = stored(cache)
    for T in (1, 300, 16384):
        arrays = {n: mx.concatenate([a] * -(-T // 300), axis=2)[:, :, :T] for n, a in full.items()}
        call = host.describe(q, cache._key_side, cache._value_side, arrays, None, tensor_cores=True,
                             tuning=DEFAULT_TUNING)
        assert type(call.pass1) is MmaPass1, T


def test_tensor_cores_can_be_turned_off(monkeypatch):
    cache = build_cache("turbo4", 2, 64, mx.float16, 300)
    args = (mx.zeros((1, 4, 1, 64), dtype=mx.float16), cache._key_side, cache._value_side, stored(cache),
            cache._shifts)
    assert isinstance(host.describe(*args, tensor_cores=True, tuning=ANY_LENGTH).pass1, MmaPass1)
    off = dataclasses.replace(ANY_LENGTH, mma=False)
    assert type(host.describe(*args, tensor_cores=True, tuning=off).pass1) is tpl.Pass1
    monkeypatch.setenv("TQSTORE_KERNEL_MMA", "0")
    assert KernelTuning.from_env() == KernelTuning(mma=False)


def test_tuning_from_the_environment(monkeypatch):
    """`from_env` builds a value from the TQSTORE_KERNEL_* variables (read at each call) and
    leaves the defaults alone; describe and plan_blocks take it when given no tuning."""
    for name in host.TUNING_ENV:
        monkeypatch.delenv(name, raising=False)
    assert KernelTuning.from_env() == DEFAULT_TUNING == KernelTuning()
    monkeypatch.setenv("TQSTORE_KERNEL_MMA", "0")
    monkeypatch.setenv("TQSTORE_KERNEL_THREADGROUPS", "24")
    monkeypatch.setenv("TQSTORE_KERNEL_NS", "2")
    monkeypatch.setenv("TQSTORE_KERNEL_UNROLL", "1")
    assert KernelTuning.from_env() == KernelTuning(ns=2, unroll=1, threadgroups=24, mma=False)
    assert DEFAULT_TUNING == KernelTuning()
    assert host.plan_blocks(65536, 8) == host.plan_blocks(65536, 8, tuning=KernelTuning(threadgroups=24))
    assert host.plan_blocks(65536, 8, tuning=DEFAULT_TUNING) != host.plan_blocks(65536, 8)
    cache = build_cache("turbo4", 2, 128, mx.float16, 300)
    args = (mx.zeros((1, 4, 1, 128), dtype=mx.float16), cache._key_side, cache._value_side, stored(cache),
            cache._shifts)
    p1 = host.describe(*args).pass1
    assert (p1.ns, p1.u) == (2, 1) and p1.lanes == (2, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TUNING.ns = 1


def _check(cache, q, scale, out, lse):
    ref_out, ref_lse = reference(cache, q, scale, with_tail=False)
    out = np.array(out).astype(np.float64)
    assert np.isfinite(out).all()
    err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
    lerr = np.abs(np.array(lse) - ref_lse).max() / max(1.0, np.abs(ref_lse).max())
    assert err <= RTOL and lerr <= RTOL, (err, lerr)


# (scheme, H, R, D, T, dtype, prefetch): every key format and value width, head dims, one and
# several row groups (R > 8), short, unaligned and multi-block token counts
EMULATED = [
    ("turbo4", 2, 4, 128, 100, mx.float16, None),
    ("turbo3", 2, 4, 256, 200, mx.bfloat16, True),
    ("turbo2", 1, 2, 80, 70, mx.float16, False),
    ("turbo4v2", 2, 7, 64, 513, mx.bfloat16, None),
    ("turbo3", 1, 12, 96, 1, mx.float16, None),
    ("turbo8v3", 2, 9, 128, 65, mx.float16, None),
    ("turbo8v3", 2, 1, 128, 300, mx.bfloat16, True),
    ("turbo8v4", 1, 7, 96, 300, mx.bfloat16, False),
    ("turbo8v2", 1, 16, 64, 200, mx.float16, True),
    ("turbo4", 2, 4, 128, 700, mx.float16, 2),
    ("turbo8v3", 1, 9, 96, 333, mx.bfloat16, 2),
    ("turbo4", 1, 17, 64, 90, mx.float16, None),
    ("turbo5v4", 2, 12, 128, 140, mx.bfloat16, 0),
]


@needs_cxx
@pytest.mark.parametrize("case", on_demand(EMULATED, {4, 5}), ids=lambda c: f"{c[0]}-H{c[1]}R{c[2]}d{c[3]}T{c[4]}-p{c[6]}")
def test_emulated_tensor_core_kernel_matches_f64_reference(case):
    scheme, H, R, D, T, dtype, prefetch = case
    cache = build_cache(scheme, H, D, dtype, T, seed=T + D)
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(D)).astype(dtype)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts, tensor_cores=True,
                         tuning=dataclasses.replace(ANY_LENGTH, mma_prefetch=prefetch))
    assert isinstance(call.pass1, MmaPass1)
    args = (call, q, cache._key_side, cache._value_side, stored(cache), 1 / math.sqrt(D), cache._shifts)
    out, lse, po, pm, pl = host.launch(emulate.kernel, *args, init_value=float("nan"), partials=True)
    assert not any(mx.any(mx.isnan(a)).item() for a in (po, pm, pl))  # every output written
    _check(cache, q, 1 / math.sqrt(D), out, lse)
    again = host.launch(emulate.kernel, *args)
    assert mx.array_equal(again[0], out).item() and mx.array_equal(again[1], lse).item()


@needs_cxx
@pytest.mark.parametrize("dtype", on_demand([mx.float16, mx.bfloat16], {0}))
def test_emulated_tensor_core_kernel_scales_the_raw_query(dtype):
    """Affine keys, with and without key means: pass 1 reads the activation-dtype query itself
    (no query op before it), through a non-contiguous view, and matches the f64 reference."""
    q = mx.random.normal((1, 1, 8, 128), key=mx.random.key(3)).astype(dtype).swapaxes(1, 2)
    for calibrated in (False, True):
        cache = build_cache("turbo8v3", 2, 128, dtype, 300, seed=5, calibrated=calibrated)
        assert (cache._shifts is None) == (not calibrated)
        call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts,
                             tensor_cores=True, tuning=ANY_LENGTH)
        assert isinstance(call.pass1, MmaPass1) and call.pass1.q_dtype == host.DTYPE_NAMES[dtype]
        assert "q_raw" in call.pass1.input_names() and "q_k" not in call.pass1.input_names()
        out, lse = host.launch(emulate.kernel, call, q, cache._key_side, cache._value_side, stored(cache),
                               1 / math.sqrt(128), cache._shifts)
        _check(cache, q, 1 / math.sqrt(128), out, lse)


def test_spread_tables_serve_turbo_keys_only():
    q = mx.zeros((1, 8, 1, 128), dtype=mx.float16)
    for scheme, spread in (("turbo4", True), ("turbo3", True), ("turbo8v3", False)):
        cache = build_cache(scheme, 2, 128, mx.float16, 64)
        call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts,
                             tensor_cores=True, tuning=ANY_LENGTH)
        assert call.pass1.spread is spread, scheme


@needs_cxx
def test_emulated_tensor_core_kernel_with_one_table_copy():
    """Unspread pair tables (one copy, `mma_spread` off) decode the same codes."""
    cache = build_cache("turbo4v3", 2, 128, mx.float16, 150, seed=9)
    q = mx.random.normal((1, 8, 1, 128), key=mx.random.key(9)).astype(mx.float16)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts, tensor_cores=True,
                         tuning=dataclasses.replace(ANY_LENGTH, mma_spread=False))
    assert isinstance(call.pass1, MmaPass1) and not call.pass1.spread
    out, lse = host.launch(emulate.kernel, call, q, cache._key_side, cache._value_side, stored(cache),
                           1 / math.sqrt(128), cache._shifts)
    _check(cache, q, 1 / math.sqrt(128), out, lse)


@needs_cxx
@pytest.mark.parametrize("threadgroups", on_demand([1, 64], {0}))
def test_emulated_benchmark_shape_one_and_many_blocks(threadgroups):
    """8 KV heads, GQA 4, d=128 as in bench/decode.py: one block per head (a long loop over
    chunks, prefetch carried across them) and many short blocks (warps with no chunk at all)."""
    cache = build_cache("turbo4", 8, 128, mx.float16, 700, seed=4)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(6)).astype(mx.float16)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts, tensor_cores=True,
                         tuning=ANY_LENGTH)
    out, lse = host.launch(emulate.kernel, call, q, cache._key_side, cache._value_side, stored(cache),
                           1 / math.sqrt(128), cache._shifts, tuning=KernelTuning(threadgroups=threadgroups))
    _check(cache, q, 1 / math.sqrt(128), out, lse)


nvcc = shutil.which("nvcc")


@pytest.mark.slow  # about 2 minutes of nvcc on 2 cores: on demand, and on the GPU machine
@pytest.mark.skipif(nvcc is None, reason="needs nvcc")
def test_tensor_core_sources_compile(tmp_path):
    """Every key format and value width at d=128 (every prefetch depth; affine keys also with the
    raw query), and every head dim with 3-bit codes (runs that start inside a word), compile for
    sm_90 as MLX assembles it."""
    seen, picks = set(), []
    for v in VARIANTS:
        if v.d == 128 and v.shifts:
            key = (v.key, v.key_bits, v.key_dtype, v.value_bits, v.prefetch, v.q_dtype)
        elif v.key_bits == 3 and v.value_bits == 3 and v.prefetch:
            key = (v.d,)
        else:
            continue
        if key not in seen and (v.key != "affine" or v.key_group == 64 or v.d != 128):
            seen.add(key)
            picks.append(v)
    # the most threadgroup memory (4-bit spread tables at d=256 and 128) and unspread tables
    picks += [v for v in VARIANTS if v.key == "turbo" and v.key_bits == v.value_bits == 4 and v.shifts
              and v.prefetch == 1 and v.d == 256]
    picks += [v for v in UNSPREAD if v.key == "turbo" and v.key_bits == v.value_bits == 4 and v.shifts]
    src = tmp_path / "mma.cu"
    src.write_text("\n".join(translation_unit(v) for v in picks))
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
