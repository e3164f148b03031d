"""Run the generated kernels on the CPU: one fiber per GPU thread (a test and debug tool).

The kernel body is the very text the CUDA and Metal kernels use (`template.body`), compiled as
C++20 with a third set of dialect macros (`emulator.h`): threadgroup memory becomes function
statics shared by the threads of the one threadgroup that runs at a time, `SYNC()` a barrier of
the threadgroup and a SIMD shuffle a barrier of the 32 threads of its SIMD group. Threadgroups run one after
another; a threadgroup's threads are fibers on the calling thread (ucontext), each running until it
waits at a barrier, then the next in turn. The order is fixed, so a missing barrier shows only
where that order exposes it. `kernel(variant)` returns a callable with the call signature of an MLX custom kernel,
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

from turboquant.attention.kernels.cuda import input_types
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.template import Pass1, body, output_names

# The third dialect: the macros and helpers of the kernel text as plain C++20 (emulator.h, read verbatim).
HEADER = Path(__file__).with_name("emulator.h").read_text(encoding="utf-8")

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
        src.write_text(HEADER + "int main() { _Float16 h = 1.5f; "
                       "int ran = 0; tq_run_group(2, [&]() { ++ran; SYNC(); ran += ran < 2 ? 100 : 10; }, new char[2 << 16], "
                       "1 << 16); return (float)h == 1.5f && ran == 22 ? 0 : 1; }\n")
        try:
            subprocess.run([cxx, "-std=c++20", str(src), "-o", str(Path(tmp) / "probe")],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([str(Path(tmp) / "probe")], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


STACK_BYTES = 1 << 18  # per GPU thread: its registers and local arrays, as a fiber's stack


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
            f"  const size_t stack = {STACK_BYTES};\n"
            "  std::unique_ptr<char[]> stacks(new char[stack * nt]);  // untouched pages cost nothing\n"
            "  for (int by = 0; by < gy; ++by) {\n"
            "    for (int bx = 0; bx < gx; ++bx) {\n"
            "      tq_bx = bx; tq_by = by;\n"
            f"      tq_run_group(nt, [&]() {{ tq_kernel({', '.join(unpack)}); }}, stacks.get(), stack);\n"
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
        subprocess.run([compiler(), "-std=c++20", "-O1", "-w", "-shared", "-fPIC", str(cc), "-o",
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
