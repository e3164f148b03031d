"""Run the generated kernels on the CPU: one OS thread per GPU thread (a test and debug tool).

The kernel body is the very text the CUDA and Metal kernels use (`template.body`), compiled as
C++20 with a third set of dialect macros: threadgroup memory becomes function statics shared by
the threads of the one threadgroup that runs at a time, `SYNC()` a barrier of the threadgroup
and a SIMD shuffle a barrier of the 32 threads of its SIMD group. Threadgroups run one after
another. `kernel(variant)` returns a callable with the call signature of an MLX custom kernel,
so `host.launch(kernel, ...)` runs the whole decode (inputs, both passes) on the CPU.

Needs a C++20 compiler (`CXX`, default g++) with `_Float16`; `available()` says whether one works.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cuda import input_types
from .merge import Pass2
from .query import Pass0
from .template import Pass1, body, output_names

HEADER = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <array>

#define TQ_LN2 0.6931471805599453f
#define DEV
#define TGMEM static
#define TQ_OUT_float32(x) (x)
#define TQ_OUT_float16(x) (x)
#define TQ_OUT_bfloat16(x) (x)
#define SYNC() tq_tg_bar->arrive_and_wait()
#define SHFL_XOR(x, m) tq_shfl_xor((x), (m))
#define EXP2(x) std::exp2((float)(x))
#define LOG2(x) std::log2((float)(x))
#define FMAX(a, b) std::fmax((float)(a), (float)(b))
#define IMIN(a, b) std::min((int)(a), (int)(b))
#define AS_FLOAT(u) tq_as_float((uint32_t)(u))
#define NEG_INF (-INFINITY)
#define CBLOOK(tbl, off) (*(const float*)((const char*)(tbl) + (off)))
struct U2 { uint32_t x, y; };
struct U4 { uint32_t x, y, z, w; };
struct F4 { float x, y, z, w; };

using Strides = std::array<int64_t, 10>;

struct tq_bf16 {
  uint16_t v;
  operator float() const { uint32_t u = (uint32_t)v << 16; float f; std::memcpy(&f, &u, 4); return f; }
};

static thread_local int tq_tid, tq_bx, tq_by;
static thread_local std::barrier<>* tq_tg_bar;
static thread_local std::barrier<>* tq_warp_bar;
static thread_local float* tq_warp_slots;

static inline float tq_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t tq_funnel(uint32_t lo, uint32_t hi, uint32_t sh) {
  return (uint32_t)(((((uint64_t)hi) << 32) | (uint64_t)lo) >> (sh & 31u));
}
static inline float tq_half(uint32_t bits) {
  uint16_t v = (uint16_t)bits;
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
}
static inline void tq_h2(uint32_t w, float& a, float& b) {
  _Float16 h[2];
  std::memcpy(h, &w, 4);
  a = (float)h[0];
  b = (float)h[1];
}
static thread_local uint32_t* tq_warp_u;
static inline uint32_t tq_pack_h2(float lo, float hi) {
  _Float16 h[2] = {(_Float16)lo, (_Float16)hi};
  uint32_t w;
  std::memcpy(&w, h, 4);
  return w;
}
static inline uint32_t tq_affine8_h2(uint32_t w, uint32_t sel, uint32_t s2, uint32_t b2) {
  const uint32_t c0 = (w >> (8 * (sel & 3u))) & 0xffu, c1 = (w >> (8 * ((sel >> 8) & 3u))) & 0xffu;
  _Float16 s, bb;
  const uint16_t sv = (uint16_t)s2, bv = (uint16_t)b2;
  std::memcpy(&s, &sv, 2);
  std::memcpy(&bb, &bv, 2);
  return tq_pack_h2((float)c0 * (float)s + (float)bb, (float)c1 * (float)s + (float)bb);
}
#define PAIRLOOK(tbl, off) (*(const uint32_t*)((const char*)(tbl) + (off)))
static inline float tq_h2f(uint32_t w, int hi) {
  const uint16_t v = (uint16_t)(hi ? (w >> 16) : (w & 0xffffu));
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
}
// mma.sync.m16n8k16 (row.col, fp16 in, float32 accumulate) with the PTX fragment layouts:
// lane = 4 * group + quad position; A regs (row g | g+8) x (k 2c.. | 2c+8..), B regs k 2c.. | 2c+8...
static inline void tq_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                          uint32_t b1) {
  const int lane = tq_tid % 32;
  uint32_t* u = tq_warp_u;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  for (int i = 0; i < 6; ++i) u[lane * 6 + i] = mine[i];
  tq_warp_bar->arrive_and_wait();
  const int g = lane >> 2, c = lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) {
      const int la = (row % 8) * 4 + (k % 8) / 2, ra = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int lb = col * 4 + (k % 8) / 2, rb = 4 + (k >= 8 ? 1 : 0);
      acc += tq_h2f(u[la * 6 + ra], k & 1) * tq_h2f(u[lb * 6 + rb], k & 1);
    }
    out[i] = acc;
  }
  tq_warp_bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
static inline float tq_shfl_xor(float x, int m);
static inline bool tq_any(bool x) {
  float s = x ? 1.0f : 0.0f;
  for (int m = 1; m < 32; m *= 2) s += tq_shfl_xor(s, m);
  return s > 0.0f;
}
#define ANY_LANE(x) tq_any((x))
static inline uint32_t tq_shfl_idx_u32(uint32_t x, int src) {
  const int lane = tq_tid % 32;
  tq_warp_u[lane] = x;
  tq_warp_bar->arrive_and_wait();
  const uint32_t y = tq_warp_u[src];
  tq_warp_bar->arrive_and_wait();
  return y;
}
#define SHFL_IDX_U32(x, src) tq_shfl_idx_u32((uint32_t)(x), (src))
static inline float tq_shfl_xor(float x, int m) {
  const int lane = tq_tid % 32;
  tq_warp_slots[lane] = x;
  tq_warp_bar->arrive_and_wait();
  const float y = tq_warp_slots[lane ^ m];
  tq_warp_bar->arrive_and_wait();
  return y;
}
"""

PROLOGUE = """const int tid = tq_tid;
const int blk = tq_bx;
const int gy = tq_by;"""

C_TYPES = {"float32": "float", "float16": "_Float16", "bfloat16": "tq_bf16", "uint32": "uint32_t",
           "int32": "int32_t"}
NP_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32,
            "int32": np.int32}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    cxx = compiler()
    if cxx is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cc"
        src.write_text("#include <barrier>\nint main() { _Float16 h = 1.5f; std::barrier<> b(1); "
                       "b.arrive_and_wait(); return (float)h == 1.5f ? 0 : 1; }\n")
        try:
            subprocess.run([cxx, "-std=c++20", "-pthread", str(src), "-o", str(Path(tmp) / "probe")],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([str(Path(tmp) / "probe")], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def translation_unit(variant: Pass0 | Pass1 | Pass2) -> str:
    types = input_types(variant)
    text = body(variant, PROLOGUE)
    outputs = output_names(variant)
    params, unpack = [], []
    for i, (name, t) in enumerate(types.items()):
        params.append(f"const {C_TYPES[t]}* {name}")
        unpack.append(f"(const {C_TYPES[t]}*)ptrs[{i}]")
        if f"{name}_strides" in text:
            params.append(f"const Strides {name}_strides")
            unpack.append(f"tq_strides(strides, {i})")
    for j, name in enumerate(outputs):
        params.append(f"float* {name}")
        unpack.append(f"(float*)ptrs[{len(types) + j}]")
    return (HEADER + "static Strides tq_strides(const int64_t* s, int i) { Strides r{}; "
            "for (int k = 0; k < 10; ++k) r[k] = s[i * 10 + k]; return r; }\n"
            f"static void tq_kernel({', '.join(params)}) {{\n{text}\n}}\n"
            "extern \"C\" void tq_run(void** ptrs, const int64_t* strides, int gx, int gy, int nt) {\n"
            "  for (int by = 0; by < gy; ++by) {\n"
            "    for (int bx = 0; bx < gx; ++bx) {\n"
            "      std::barrier<> tg(nt);\n"
            "      std::vector<std::barrier<>*> warps;\n"
            "      std::vector<std::vector<float>> slots(nt / 32, std::vector<float>(32));\n"
            "      std::vector<std::vector<uint32_t>> uslots(nt / 32, std::vector<uint32_t>(32 * 6));\n"
            "      for (int w = 0; w < nt / 32; ++w) warps.push_back(new std::barrier<>(32));\n"
            "      std::vector<std::thread> threads;\n"
            "      for (int t = 0; t < nt; ++t) {\n"
            "        threads.emplace_back([&, t]() {\n"
            "          tq_tid = t; tq_bx = bx; tq_by = by; tq_tg_bar = &tg;\n"
            "          tq_warp_bar = warps[t / 32]; tq_warp_slots = slots[t / 32].data();\n"
            "          tq_warp_u = uslots[t / 32].data();\n"
            f"          tq_kernel({', '.join(unpack)});\n"
            "        });\n"
            "      }\n"
            "      for (auto& th : threads) th.join();\n"
            "      for (auto* w : warps) delete w;\n"
            "    }\n"
            "  }\n"
            "}\n")


_BUILD = Path(tempfile.gettempdir()) / "tq_kernel_emulator"


@functools.lru_cache(maxsize=None)
def _library(variant: Pass0 | Pass1 | Pass2):
    src = translation_unit(variant)
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    _BUILD.mkdir(parents=True, exist_ok=True)
    so = _BUILD / f"{variant.name}_{digest}.so"
    if not so.exists():
        cc = _BUILD / f"{variant.name}_{digest}.cc"
        cc.write_text(src)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler(), "-std=c++20", "-O1", "-w", "-pthread", "-shared", "-fPIC", str(cc), "-o",
                        str(tmp)], check=True, capture_output=True, timeout=600)
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.tq_run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                           ctypes.c_int, ctypes.c_int]
    return lib


def _to_numpy(a: mx.array, t: str) -> np.ndarray:
    if t == "bfloat16":
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a), dtype=NP_TYPES[t])


class _Kernel:
    def __init__(self, variant: Pass0 | Pass1 | Pass2):
        self.variant = variant

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
        types = list(input_types(self.variant).values())
        arrays = [_to_numpy(a, t) for a, t in zip(inputs, types)]
        outs = [np.full(s, np.nan if init_value is None else init_value, dtype=np.float32) for s in output_shapes]
        strides = np.zeros((len(arrays), 10), dtype=np.int64)
        for i, a in enumerate(arrays):
            strides[i, : a.ndim] = [s // a.itemsize for s in a.strides]
        ptrs = (ctypes.c_void_p * (len(arrays) + len(outs)))(*[a.ctypes.data for a in arrays + outs])
        nt = threadgroup[0]
        _library(self.variant).tq_run(ptrs, strides.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                      grid[0] // nt, grid[1], nt)
        # (outputs are float32 here; an activation-dtype output is rounded as the GPU's store would)
        return [mx.array(o).astype(dt) for o, dt in zip(outs, output_dtypes)]


def kernel(variant: Pass0 | Pass1 | Pass2) -> _Kernel:
    return _Kernel(variant)
